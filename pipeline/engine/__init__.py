"""Engine stage: the one block table, request states, prefix cache, scheduling, preemption."""
