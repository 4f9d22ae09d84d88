"""What servelm tunes in the machine under it, outside any one engine: ``memory.py``, glibc's malloc
thresholds and transparent huge pages (Linux, CPU only)."""
