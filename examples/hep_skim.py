"""A coffea NanoEvents skim on raydag, checked against dask's sync scheduler.

It makes a small synthetic NanoAOD/PFNano-like dataset with uproot (jagged Jet, FatJet,
Muon and PFCands collections, run/luminosityBlock/event), then runs one skim two ways:

- dask: NanoEvents in dask mode, ``dask_awkward.to_parquet`` and a ``hist.dask``
  histogram computed with ``scheduler=raydag.ray_get`` (the keyword arguments another
  backend's get takes are passed too, as a user's script does), and again with
  ``scheduler="sync"``;
- coffea's ``processor.Runner`` with ``raydag.coffea.RayExecutor``: each chunk writes its
  skim to parquet and returns the histogram, tree-reduced on the cluster.

Row counts and histogram contents must be equal across all three. raydag uses the Ray
that is initialised, or ``RAY_ADDRESS`` (set inside ``ray job submit``), or an embedded one.

    python examples/hep_skim.py [--files 4] [--events 20000] [--out /tmp/hep-skim]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import awkward as ak
import dask
import dask_awkward as dak
import hist
import hist.dask
import numpy as np
from coffea import processor
from coffea.nanoevents import NanoAODSchema, NanoEventsFactory

import raydag

logger = logging.getLogger("hep_skim")

TREE = "Events"
HT_AXIS = (30, 0.0, 1500.0)


# ---- the synthetic dataset -----------------------------------------------------------


def _collection(rng: np.random.Generator, counts: np.ndarray, fields: dict) -> ak.Array:
    """A jagged collection: one record per object, ``counts`` objects per event."""
    n = int(counts.sum())
    columns = {name: make(rng, n) for name, make in fields.items()}
    return ak.unflatten(ak.zip(columns), counts)


def _kinematics(pt_scale: float, mass_scale: float) -> dict:
    return {
        "pt": lambda r, n: (r.exponential(pt_scale, n) + 5.0).astype(np.float32),
        "eta": lambda r, n: r.normal(0.0, 1.6, n).astype(np.float32),
        "phi": lambda r, n: r.uniform(-np.pi, np.pi, n).astype(np.float32),
        "mass": lambda r, n: r.exponential(mass_scale, n).astype(np.float32),
    }


def make_events(seed: int, n: int, run: int) -> dict[str, Any]:
    """One file's worth of events, with NanoAOD's branch layout once uproot writes it."""
    rng = np.random.default_rng(seed)
    jet = _collection(
        rng,
        rng.poisson(4.0, n),
        {
            **_kinematics(35.0, 8.0),
            "btagDeepFlavB": lambda r, n: r.uniform(0, 1, n).astype(np.float32),
            "jetId": lambda r, n: r.choice(np.array([0, 2, 6], np.int32), n, p=[0.05, 0.15, 0.8]),
        },
    )
    fatjet = _collection(
        rng,
        rng.poisson(0.8, n),
        {
            **_kinematics(150.0, 40.0),
            "msoftdrop": lambda r, n: r.exponential(50.0, n).astype(np.float32),
            "particleNet_XbbVsQCD": lambda r, n: r.uniform(0, 1, n).astype(np.float32),
        },
    )
    muon = _collection(
        rng,
        rng.poisson(1.2, n),
        {
            **_kinematics(25.0, 0.0),
            "charge": lambda r, n: r.choice(np.array([-1, 1], np.int32), n),
            "tightId": lambda r, n: r.uniform(0, 1, n) < 0.8,
            "pfRelIso04_all": lambda r, n: r.exponential(0.1, n).astype(np.float32),
        },
    )
    muon["mass"] = ak.full_like(muon.pt, 0.1057)
    pfcands = _collection(
        rng,
        rng.poisson(20.0, n),
        {
            **_kinematics(3.0, 0.1),
            "charge": lambda r, n: r.choice(np.array([-1, 0, 1], np.int32), n),
            "pdgId": lambda r, n: r.choice(np.array([211, -211, 22, 130, 11, 13], np.int32), n),
        },
    )
    first = seed * n
    return {
        "run": np.full(n, run, np.uint32),
        "luminosityBlock": (np.arange(n) // 500 + 1).astype(np.uint32),
        "event": np.arange(first, first + n, dtype=np.uint64),
        "genWeight": rng.normal(1.0, 0.1, n).astype(np.float32),
        "MET": ak.zip(
            {
                "pt": rng.exponential(40.0, n).astype(np.float32),
                "phi": rng.uniform(-np.pi, np.pi, n).astype(np.float32),
            }
        ),
        "Jet": jet,
        "FatJet": fatjet,
        "Muon": muon,
        "PFCands": pfcands,
    }


def make_dataset(directory: Path, files: int, events: int) -> list[str]:
    """Write ``files`` ROOT files of ``events`` events each (kept if already there)."""
    import uproot

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(files):
        path = directory / f"nano_{events}_{i}.root"
        if not path.exists():
            tmp = path.with_suffix(".root.tmp")
            with uproot.recreate(tmp) as f:
                # several baskets per file, as a real file has
                step = max(1, events // 4)
                for start in range(0, events, step):
                    batch = make_events(i * 1000 + start // step, min(step, events - start), 1)
                    if start == 0:  # NanoAOD is a TTree (uproot's dict syntax makes RNTuples)
                        f.mktree(TREE, batch)
                    else:
                        f[TREE].extend(batch)
            tmp.rename(path)
        paths.append(str(path))
    logger.info("dataset: %d files of %d events in %s", files, events, directory)
    return paths


class SyntheticNanoSchema(NanoAODSchema):
    """NanoAOD's schema, quiet about the collections (Tau, Photon...) these files lack."""

    warn_missing_crossrefs = False


# ---- the skim: the same code on dask and on eager (virtual) NanoEvents --------------


def skim(events: Any) -> Any:
    """Events with a good muon and two good jets, with a few new columns."""
    muons = events.Muon
    good_mu = muons[(muons.pt > 20) & (abs(muons.eta) < 2.4) & muons.tightId]
    jets = events.Jet
    good_jet = jets[(jets.pt > 30) & (abs(jets.eta) < 2.5) & (jets.jetId >= 2)]
    charged = events.PFCands[events.PFCands.charge != 0]
    keep = (ak.num(good_mu, axis=1) >= 1) & (ak.num(good_jet, axis=1) >= 2)

    good_jet = good_jet[keep]
    fatjets = events.FatJet[keep]
    return ak.zip(
        {
            "run": events.run[keep],
            "luminosityBlock": events.luminosityBlock[keep],
            "event": events.event[keep],
            "HT": ak.sum(good_jet.pt, axis=1),
            "nGoodJet": ak.num(good_jet, axis=1),
            "nBJet": ak.sum(good_jet.btagDeepFlavB > 0.7, axis=1),
            "muon_pt": ak.firsts(good_mu[keep].pt),
            "fatjet_msd": ak.fill_none(ak.firsts(fatjets.msoftdrop), -1.0),
            "nChargedPF": ak.num(charged[keep], axis=1),
            "MET_pt": events.MET.pt[keep],
            "Jet_pt": good_jet.pt,
            "Jet_eta": good_jet.eta,
        },
        depth_limit=1,
    )


def fill_hist(h: Any, skimmed: Any) -> Any:
    return h.fill(ht=skimmed.HT)


def _new_hist(module: Any) -> Any:
    return module.Hist.new.Reg(*HT_AXIS, name="ht", label="HT [GeV]").Double()


def dask_skim(files: list[str], steps_per_file: int, out: Path) -> tuple[Any, Any]:
    """The lazy parquet write and histogram, in dask mode (as coffea 2024+ analyses are)."""
    with warnings.catch_warnings():  # steps_per_file is fine for a fixed, small dataset
        warnings.filterwarnings("ignore", message="You have set steps_per_file")
        events = NanoEventsFactory.from_root(
            {f: TREE for f in files},
            schemaclass=SyntheticNanoSchema,
            mode="dask",
            steps_per_file=steps_per_file,
        ).events()
    skimmed = skim(events)
    write = dak.to_parquet(skimmed, str(out), compute=False)
    return write, fill_hist(_new_hist(hist.dask), skimmed)


class SkimProcessor(processor.ProcessorABC):
    """The same skim for ``processor.Runner``: each chunk writes its part, returns counts."""

    def __init__(self, out: str):
        self.out = out

    def process(self, events: Any) -> dict:
        skimmed = skim(events)
        meta = events.metadata
        name = f"{Path(meta['filename']).stem}-{meta['entrystart']}-{meta['entrystop']}.parquet"
        ak.to_parquet(skimmed, os.path.join(self.out, name))
        return {
            "hist": fill_hist(_new_hist(hist), skimmed),
            "rows": len(skimmed),
            "events": len(events),
        }

    def postprocess(self, accumulator: dict) -> dict:
        return accumulator


def parquet_rows(directory: Path) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(p).metadata.num_rows for p in sorted(directory.glob("*.parquet")))


def ship_by_value() -> None:
    """Ray workers may not be able to import this file: send its code with the tasks."""
    import cloudpickle
    import ray.cloudpickle

    module = sys.modules[__name__]
    if module.__name__ != "__main__":
        cloudpickle.register_pickle_by_value(module)
        ray.cloudpickle.register_pickle_by_value(module)


# ---- the runs -----------------------------------------------------------------------

# What a user's script passes to another backend's get; raydag accepts and ignores them.
FOREIGN_KWARGS = {
    "worker_transfers": True,
    "resources": {"cores": 1},
    "task_mode": "function-calls",
    "lib_resources": {"cores": 6, "slots": 6},
    "prune_depth": 2,
}


def run_dask(files: list[str], steps: int, out: Path, scheduler: Any, **kwargs: Any) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    write, h = dask_skim(files, steps, out)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="raydag ignores these keyword arguments")
        _, h = dask.compute(write, h, scheduler=scheduler, **kwargs)
    seconds = time.perf_counter() - t0
    return {"rows": parquet_rows(out), "hist": h.values(), "seconds": seconds}


def run_runner(files: list[str], chunksize: int, out: Path, executor: Any) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    runner = processor.Runner(executor=executor, schema=SyntheticNanoSchema, chunksize=chunksize)
    t0 = time.perf_counter()
    result = runner({"synthetic": files}, SkimProcessor(str(out)), treename=TREE)
    seconds = time.perf_counter() - t0
    if parquet_rows(out) != result["rows"]:
        raise AssertionError(f"runner wrote {parquet_rows(out)} rows, counted {result['rows']}")
    return {"rows": result["rows"], "hist": result["hist"].values(), "seconds": seconds}


def check_same(name: str, got: dict, want: dict) -> None:
    if got["rows"] != want["rows"] or not np.array_equal(got["hist"], want["hist"]):
        raise AssertionError(
            f"{name} differs from sync: rows {got['rows']} vs {want['rows']}, "
            f"histogram entries {got['hist'].sum()} vs {want['hist'].sum()}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=4, help="ROOT files to make")
    parser.add_argument("--events", type=int, default=20_000, help="events per file")
    parser.add_argument("--steps", type=int, default=2, help="dask partitions per file")
    parser.add_argument("--out", type=Path, default=Path("/tmp/hep-skim"), help="output dir")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    import ray

    from raydag.coffea import RayExecutor

    files = make_dataset(args.out / "data", args.files, args.events)
    raydag.connect()
    ctx = ray.get_runtime_context()
    logger.info(
        "cluster: gcs %s, job %s, %s CPUs",
        ctx.gcs_address,
        ctx.get_job_id(),
        ray.cluster_resources().get("CPU"),
    )
    ship_by_value()

    results = {
        "sync": run_dask(files, args.steps, args.out / "skim-sync", "sync"),
        "raydag": run_dask(
            files, args.steps, args.out / "skim-raydag", raydag.ray_get, **FOREIGN_KWARGS
        ),
        "runner": run_runner(
            files,
            max(1, args.events // args.steps),
            args.out / "skim-runner",
            RayExecutor(status=False),
        ),
    }
    for name in ("raydag", "runner"):
        check_same(name, results[name], results["sync"])
    want = results["sync"]
    print(
        f"skimmed {args.files} x {args.events} events: {want['rows']} rows kept, "
        f"HT histogram of {int(want['hist'].sum())} entries, equal in every run:"
    )
    for name, r in results.items():
        print(
            f"  {name:7} {r['seconds']:7.2f} s  {r['rows']} rows  -> {args.out / ('skim-' + name)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
