"""``servelm bench serve``: a serving benchmark for any OpenAI-compatible server.

``dataset`` builds the prompts, ``client`` sends one streamed request and
times it, ``runner`` schedules a level's requests (fixed concurrency or
Poisson arrivals), ``metrics`` turns results into a summary, ``report``
prints, writes and plots it, ``session`` runs it all, and ``cli`` holds the
flags. See docs/BENCHMARKS.md.
"""
