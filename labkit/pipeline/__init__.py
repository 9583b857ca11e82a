"""Pipeline parallelism: schedules as data, a validator, a simulator and a real executor.

    labkit.pipeline.schedules   GPipe, 1F1B, interleaved 1F1B: per stage, the ordered actions
    labkit.pipeline.zero_bubble ZB-H1, ZB-H2 and ZB-V (2 chunks per stage in a V): B and W split
    labkit.pipeline.validate    dependencies and deadlock; the first bad action named
    labkit.pipeline.simulate    timeline, bubble fraction, peak in-flight micro-batches
    labkit.pipeline.executor    runs a schedule on real processes on labkit.model's GPT
    labkit.pipeline.causality   is a measured timeline causal, is its bubble above its floor

Import the submodule you need (`from labkit.pipeline import schedules`); nothing runs at import.
"""
