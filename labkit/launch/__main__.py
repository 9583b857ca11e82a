"""`python -m labkit.launch RUNDIR RANK`: start one rank of a run (labkit.launch.process does)."""
import sys

if __name__ == "__main__":
    # Run the rank from the imported package (not a __main__ copy), so that `note()` called by
    # user code as labkit.launch.note sees the same module state.
    from labkit.launch.rank import main

    main(sys.argv[1], int(sys.argv[2]))
