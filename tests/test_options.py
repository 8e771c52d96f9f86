"""Ray task options per task (``raydag.core.options``) and what the state machine does
with them: fusion keeps tasks of different options apart, a pinned task is neither
placed nor duplicated, each Submit carries its root's options. No Ray here."""

from __future__ import annotations

import pytest
from test_state import CHEAP, chain, finish, fusion_config, make, submits

from raydag.core.options import OptionsError, task_options


def test_keyword_under_annotation_as_ray_merges_them():
    """Ray's precedence: the keyword's dict updated with the key's annotation (top
    level: the annotation's resources replace the keyword's); resource options become
    raydag's resources, the rest is passed through as given."""
    strategy = object()
    opts = task_options(
        ["a", "b", "c"],
        {
            "ray_remote_args": {
                "a": {"resources": {"pin": 0.01}, "scheduling_strategy": strategy},
                "b": {"num_gpus": 1},
            },
            "resources": {"c": {"CPU": 3}},
        },
        {"num_cpus": 2, "max_retries": 1, "resources": {"other": 1}},
    )
    assert opts.resources == {
        "a": {"CPU": 2, "pin": 0.01},
        "b": {"CPU": 2, "GPU": 1, "other": 1},
        "c": {"CPU": 2, "other": 1},  # ray_remote_args' num_cpus over resources' CPU
    }
    assert opts.remote_args == {
        "a": {"max_retries": 1, "scheduling_strategy": strategy},
        "b": {"max_retries": 1},
        "c": {"max_retries": 1},
    }
    assert opts.remote_args["b"] is opts.remote_args["c"]  # one object per distinct dict
    assert opts.pinned == {"a", "b", "c"}  # a strategy; custom resources


def test_no_options_no_facts():
    opts = task_options(["a", "b"], {"resources": {"a": {"CPU": 2}}})
    assert opts.resources == {"a": {"CPU": 2}}
    assert opts.remote_args == {} and opts.pinned == set()


@pytest.mark.parametrize(
    ("keyword", "annotation", "error", "match"),
    [
        (["num_cpus", 1], None, TypeError, "ray_remote_args must be a dict"),
        (None, "SPREAD", TypeError, r"dask.annotate\(ray_remote_args=...\) of 'a' must be a dict"),
        ({"num_returns": 2}, None, OptionsError, "may not set 'num_returns'"),
        ({"resources": 1}, None, OptionsError, "'resources' must be a dict"),
    ],
)
def test_bad_options_are_refused_before_anything_runs(keyword, annotation, error, match):
    annotations = {"ray_remote_args": {"a": annotation}} if annotation is not None else {}
    with pytest.raises(error, match=match):
        task_options(["a"], annotations, keyword)


def test_validation_error_names_the_key_and_options():
    def validate(options):
        raise ValueError("Invalid option keyword num_cpu")

    with pytest.raises(OptionsError, match=r"ray_remote_args of 'a' \(\{'num_cpu': 1\}\)"):
        task_options(["a"], {}, {"num_cpu": 1}, validate=validate)


def test_fusion_keeps_tasks_of_different_remote_args_apart():
    """A cheap chain fuses, but not across a change of Ray options: each group's
    Submit carries its root's options."""
    pinned = {"scheduling_strategy": "SPREAD"}
    other = {"max_retries": 2}
    args = {"k0": other, "k1": other, "k2": other, "k3": pinned, "k4": pinned, "k5": pinned}
    s = make(chain(6), {"k5"}, fusion=fusion_config(), category=lambda k: "c", remote_args=args)
    (first,) = submits(s.start())
    assert first.keys == ("k0",) and first.remote_args == other
    (second,) = submits(finish(s, first, CHEAP))
    assert second.keys == ("k1", "k2") and second.remote_args == other
    (third,) = submits(finish(s, second, CHEAP))
    assert third.keys == ("k3", "k4", "k5") and third.remote_args == pinned
    finish(s, third, CHEAP)
    assert s.done


def test_pinned_tasks_are_not_duplicated():
    """Speculation duplicates a long lone task on an idle node, unless the user's
    options say where it runs."""
    from raydag.core.events import TaskStarted, Tick
    from raydag.core.speculation import Speculation

    spec = Speculation(enabled=True, long_task=1.0, min_runtime=0.0, quantile=None)
    for pinned in (False, True):
        s = make(
            {"a": set()},
            {"a"},
            nodes={"n1": 2, "n2": 2},
            speculation=spec,
            seed_runtimes={"a": [5.0]},
            pinned={"a"} if pinned else (),
        )
        (sub,) = submits(s.start())
        s.handle(TaskStarted(sub.copy, "n1", 100.0))
        out = s.handle(Tick(110.0, {"n1": 1, "n2": 2}))
        s.validate_state()
        assert bool(submits(out)) is not pinned, out
