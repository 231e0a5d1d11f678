// Worker stage, CUDA ops: the stream-ordered per-layer "KV written" signal.
//
// The worker records the layer's KV write on the compute stream, makes a side stream wait
// for it, and calls pipeline_cuda_enqueue_layer_signal on the side stream. The host function
// runs on a CUDA driver thread once the write is done and calls pipeline_signal_publish from
// cython_ext/shm_atomic.h: a release store of the layer's sequence number and a semaphore
// post only when the cache messager is parked. No Python, no GIL, no polling. The only
// state is the small heap argument of each pending host function, freed when it runs.
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>

#include "pipeline_cuda.h"
#include "shm_atomic.h"

namespace {

struct SignalArg {
  void* shm_base;
  int64_t step;
  int layer;
};

void CUDART_CB publish_layer(void* user) {
  const SignalArg arg = *static_cast<SignalArg*>(user);
  free(user);
  pipeline_signal_publish(arg.shm_base, arg.step, arg.layer);
}

}  // namespace

extern "C" int pipeline_cuda_enqueue_layer_signal(void* stream, void* shm_base, int64_t step,
                                                  int layer) {
  SignalArg* arg = static_cast<SignalArg*>(malloc(sizeof(SignalArg)));
  if (arg == nullptr) return PIPELINE_CUDA_ENOMEM;
  arg->shm_base = shm_base;
  arg->step = step;
  arg->layer = layer;
  const cudaError_t err =
      cudaLaunchHostFunc(static_cast<cudaStream_t>(stream), publish_layer, arg);
  if (err != cudaSuccess) {
    free(arg);  // never enqueued: the callback will not run
    return (int)err;
  }
  return PIPELINE_CUDA_OK;
}
