"""Every chapter's lab as a script: `labkit run NAME --nproc N`, or under torchrun.

One module per lab with `main(argv)`. Each lab calls labkit.launch.run, which starts N local
processes, or, under `torchrun`, runs as the current rank; rank 0 prints a line per finished
phase (labkit.progress) and ends with a table.

A lab module may say BACKEND = "gloo" (its ranks keep their tensors on the CPU): `labkit run`
then hides the GPUs from it, so it runs on Gloo even on a GPU machine; BACKEND = "auto" labs put
their tensors on labkit.launch.device() and run on NCCL where there is a GPU per rank.

CHAPTER_LABS says which lab belongs to which chapter (`labkit list` prints it; a test checks that
every chapter has one and that each exists)."""

CHAPTER_LABS = {
    0: ("Why distribute?", ["intro"]),
    1: ("Collectives and ring all-reduce", ["ring"]),
    2: ("Data parallelism (DDP)", ["ddp"]),
    3: ("ZeRO and FSDP", ["zero"]),
    4: ("Tensor parallelism", ["tp"]),
    5: ("Pipeline parallelism", ["pipeline"]),
    6: ("Checkpointing and fault tolerance", ["checkpoint", "train_ft"]),
    7: ("Putting it together: 3D parallelism", ["hybrid"]),
}
