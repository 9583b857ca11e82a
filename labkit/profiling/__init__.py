"""Real profiler traces of labkit runs: record them, read them back, draw them, and memory.

    folder   --trace DIR checked (no torch imported), file names, how to open the files
    record   torch.profiler on each rank, one Chrome/Perfetto JSON per rank (traced, label)
    jobs     rank functions that run DDP, ZeRO-3 or a pipeline step under the profiler, with
             record_function labels, and return labkit's own timeline of the same step
    read     the trace file parsed back: events, interval unions, compute / communication /
             overlapped / exposed time and a pipeline's bubble, on the trace's own timestamps
    plot     a plotly timeline of the trace (per rank, per thread lane), beside labkit's own
    memory   one ZeRO-3 step's memory over time: the CUDA caching allocator's history on a GPU,
             saved-tensor and parameter-storage counts sampled at every operator on the CPU

No module here is imported by labkit's core; labs and chapters import the modules they use.
"""
