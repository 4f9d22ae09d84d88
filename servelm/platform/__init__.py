"""What servelm tunes in, and asks of, the machine under it, outside any one engine: ``memory.py``,
glibc's malloc thresholds and transparent huge pages (Linux, CPU only); ``arena.py``, one malloc arena
for every thread (Linux, set at ``import servelm``); ``threads.py``, torch work off the engine's
thread in threads that end, so that their OpenMP teams do not slow the engine's; ``cpu.py``, whether
oneDNN has bfloat16 instructions on this CPU; ``cache.py``, servelm's folder in the user's cache."""
