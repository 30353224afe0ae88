"""BrownoutServe: united experts (:mod:`.united`), brownout routing around any ExpertFn
(:mod:`.routing`) and the SLO-aware latency controller SALC (:mod:`.salc`)."""
