"""Gluon kernels for Hopper (sm90): warp-specialized, TMA and wgmma, FA3's designs.

    scope.py             which calls they take, and why not (pure Python; the registry asks)
    common.py            what the kernels share: work items, the K/V loader, descriptors
    forward.py           the forward
    backward_split.py    the dK/dV and dQ kernels (d256: dV, dK, dQ), bitwise reproducible
    backward_onepass.py  one kernel for all three gradients, dQ by TMA reductions (d64, d128)
    tma_reduce.py        the bulk TMA reduction, which triton 3.6's Gluon does not export
"""
