"""Memory timelines for the lessons and benchmarks: the recorder (memory_timeline), a model of
the CUDA caching allocator (allocator_model) and the plots (plots)."""
