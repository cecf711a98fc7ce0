"""The vocabulary every layer shares (DESIGN.md section 2): raf_dist's custom Relax ops with
their type inference and gradients (``ops``), the markers the frontends and the step builder
leave for the passes, the IR attributes that say where parameters and states sit (``attrs``)
and small IR utilities (``utils``). Imports TVM only."""
