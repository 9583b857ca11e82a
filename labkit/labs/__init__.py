"""Every chapter's lab as a script: `labkit run NAME --nproc N`, or under torchrun.

One module per lab with `main(argv)`. Each lab calls labkit.launch.run, which starts N local
processes, or, under `torchrun`, runs as the current rank; rank 0 prints the table."""
