"""What runs a problem: the registry that chooses, and the kernel families.

    registry.py   which family and kernel run a call, and why (the one place a family is
                  chosen; ``flashtile explain`` prints its answers)
    run.py        the launch path of the ops: choose, allocate, launch, replay
    configs.py    launch configurations per (GPU arch, head dim, dtype, causal)
    layout.py     tensor layouts at the kernels' boundary, TMA readiness, paged keys
    worklist.py   the device-built work list of packed (varlen) calls
    probs.py      S_dmask (return_attn_probs with dropout)
    twin/         plain torch: the semantics on CPU tensors (and the kernels' Philox mask)
    triton/       portable Triton: scores.py (the one score pipeline), forward, backward,
                  decode (kv cache)
    sm90/         Gluon for Hopper: scope.py (which calls it takes), common.py, forward,
                  backward_split, backward_onepass, tma_reduce
"""
