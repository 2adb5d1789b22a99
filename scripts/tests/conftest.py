"""Tests of the investigation tools in scripts/ (outside CI: `python -m pytest scripts/tests`).

They read the kernels' source as text (the trace tools stamp copies of it), so a kernel edit
that moves an anchor fails here, where it concerns the tools, not in the project's suite."""
