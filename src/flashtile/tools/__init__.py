"""The ``flashtile`` command's tools, and the developers'.

    bench/            ``flashtile bench``: prefill, varlen and decode against the peers
    explain.py        ``flashtile explain``: the registry's answer for a described call
    check.py          ``flashtile check``: every API against float64, pass or fail
    demo.py           ``flashtile demo``: the algorithm's demonstrations
    traffic_measure.py  ``flashtile traffic --measure``: DRAM bytes from the GPU's counters
    sm90_check.py     ``python -m flashtile.tools.sm90_check``: compile every kernel for
                      Hopper on a machine without a GPU
"""
