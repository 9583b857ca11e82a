"""Interactive views (ipywidgets + plotly) over labkit.costs and over measured traces.

One module per topic (labkit.widgets.ring, .memory, .pipeline, ...); each builds its figures
from labkit.costs, so a widget and a worked answer in the text can never disagree. A calculator's
controls are a CONTROLS list (labkit.widgets.controls) from which both its ipywidgets and the
website's calculator (labkit.widgets.web) are built."""
