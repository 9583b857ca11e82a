"""Moved to labkit.observe.commlog; this name stays for the notebooks and the code that import
`from labkit import commlog` (chapters 01-10, labkit.zero, labkit.check, labkit.labs)."""
from labkit.observe.commlog import (  # noqa: F401
                                    Event,
                                    Log,
                                    all_gather_into,
                                    all_gather_list,
                                    all_reduce,
                                    all_to_all_single,
                                    broadcast,
                                    composite,
                                    dim_of,
                                    name_group,
                                    nbytes,
                                    p2p_posted,
                                    posted,
                                    record,
                                    recording,
                                    reduce_scatter_into,
)
