"""Upper bounds on every user number that sizes work (README, "Limits").

A number past its bound is refused up front with a :class:`~moefleet.errors.LimitError`
(or a CLI usage error) naming the limit, before anything is allocated; the bounds are
generous for real use and small enough that no command can be asked for more memory or
time than a workstation has. Change them here, and only here.
"""

from __future__ import annotations

MAX_SEED = 2**32 - 1  # numpy's SeedSequence accepts more, but 32 bits is portable
MAX_TOKENS = 10**8  # tokens profiled / run / planned per batch
MAX_BATCH_TOKENS = 10**7  # tokens in one BO batch / scored batch
MAX_PROMPT_TOKENS = 10**6  # tokens of one simulated request (prompt or output)
MAX_REPLICAS = 1000  # replicas per expert a planner may choose
MAX_WORKERS = 64  # local worker processes
MAX_TIME_LIMIT_S = 86_400.0  # solver time limit
MAX_ITERATIONS = 10_000  # BO iterations
MAX_PAIRS = 20_000  # BO key-value pairs per trial (each is two optimiser parameters)
MAX_DURATION_S = 30 * 86_400.0  # simulated seconds of arrivals
MAX_ARRIVALS = 2_000_000  # simulated requests (rate x duration); ~1 GB of events at most
MAX_SIM_TOKEN_STEPS = 10**7  # simulated requests x decode steps (~3 min of events at most)
MAX_CALL_TOKENS = 65_536  # tokens per timed call in profile-compute
MAX_MEMORY_OPTIONS = 100_000  # memory sizes one platform offers
MAX_PLATFORM_REPLICAS = 100_000  # a platform's replica limit
