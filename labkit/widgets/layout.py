"""Figure layouts a 390 px phone shows as well as a notebook (the website draws the same figures).

    from labkit.widgets.layout import fits_a_phone
    fits_a_phone(fig, 60)     # legend in rows at the foot, title wrapped, 60 px taller
"""
from __future__ import annotations

import textwrap


def fits_a_phone(fig, extra_height: int = 0) -> None:
    """A 390 px phone as well as a notebook: the legend in rows at the foot of the figure (on the
    right it takes half a phone's width from the plot), the title wrapped at 40 characters, no
    fixed width (the page sizes the figure)."""
    title = fig.layout.title.text or ""
    fig.update_layout(title="<br>".join(textwrap.wrap(title, 40)),
                      legend=dict(orientation="h", yref="container", yanchor="bottom", y=0, x=0),
                      margin=dict(r=20, b=110), height=(fig.layout.height or 450) + extra_height)
