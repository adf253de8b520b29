"""Everything alchemist does to PyTensor beyond its public API, in one package, switched on only around alchemist's
own graph building and compiling (`host.activated()`): the flags it sets, the compile speed-ups that wrap PyTensor's
linker, compiler and validator (fast_link, parallel_build, compile_progress, fast_supervisor, fast_cycles) and the one module
that imports PyTensor's private symbols (pytensor_internals), each tested against the pinned PyTensor series."""
