"""The emulated in-network aggregation switch (SHARP / NetReduce style) of aggregation rails:
``table`` (keys in progress, bounded), ``pacing`` (the switch's reduction rate), ``service``
(the asyncio server the fabric runs in the rail's switch namespace), ``control`` (start it
there, read it back, stop it)."""
