"""Tokenizer stage: text or chat messages -> token ids, and the one request validator.

- stage: the process loop (gateway -> tokenizer -> token processor / engine)
- tokenizer: `Tokenizer` (Hugging Face `tokenizers` + the model's chat template)
- validate: `validate_request`, the checks every way in shares
"""
