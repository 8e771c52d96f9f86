"""The live progress in Jupyter: a real kernel runs a compute, its output is a widget.

The notebook is executed by ``nbclient`` in an ipykernel of this interpreter, as a user's
notebook would be; the kernel starts its own embedded Ray (it is another process).
"""

from __future__ import annotations

import os

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")
pytest.importorskip("ipywidgets")

pytestmark = [pytest.mark.slow, pytest.mark.ray_only, pytest.mark.timeout(300)]

WIDGET = "application/vnd.jupyter.widget-view+json"

CELLS = [
    "import dask, dask.array as da, raydag",
    # 100 chunks summed: a few hundred tasks, each result coming back moves the bar
    "x = da.ones((2000, 2000), chunks=200).sum()\n"
    "v = x.compute(scheduler=raydag.ray_get)\n"
    "print('value', int(v))",
    "rec = raydag.last_run()\nprint('tasks', rec.meta['graph']['tasks'])",
]


def test_progress_is_a_widget_in_jupyter(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in CELLS]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    client = nbclient.NotebookClient(
        nb,
        timeout=240,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
        store_widget_state=True,
    )
    client.execute(env=env)  # the kernel's environment: no RAY_ADDRESS, its own Ray

    outputs = nb.cells[1].outputs
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "value 4000000" in text, outputs
    widgets = [o for o in outputs if o.output_type == "display_data" and WIDGET in o.data]
    assert widgets, f"no progress widget among the outputs: {outputs}"
    # nothing drawn as text on stderr instead: the widget is the display
    assert not [o for o in outputs if o.get("name") == "stderr" and "%|" in o.get("text", "")]

    # The bar's final state, as the kernel left it: every task done, out of all of them.
    tasks = int(nb.cells[2].outputs[0]["text"].split()[1])
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    bars = [w["state"] for w in state.values() if w["model_name"] == "FloatProgressModel"]
    assert bars, state
    bar = bars[-1]
    assert bar["max"] == tasks and bar["value"] == tasks, bar
    labels = [w["state"].get("value", "") for w in state.values() if w["model_name"] == "HTMLModel"]
    assert any(f"{tasks}/{tasks}" in label for label in labels), labels
