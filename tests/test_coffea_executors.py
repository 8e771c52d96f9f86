"""coffea's own executor tests (``tests/test_local_executors.py`` of scikit-hep/coffea,
``test_nanoevents_analysis``), with ``RayExecutor`` beside coffea's executors.

Restated here, as coffea's wheel does not ship its tests, on the real NanoAOD files of
coffea's test suite (``tests/samples``, coffea's BSD licence). The ROOT TTree cases
only: the RNTuple and parquet copies of those files are not in the samples. The file
coffea keeps with its events under another tree name (``nano_dy_SpecialTree.root``) is
made here from ``nano_dy.root`` with uproot.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("coffea")
uproot = pytest.importorskip("uproot")
ak = pytest.importorskip("awkward")
pyarrow = pytest.importorskip("pyarrow")

from coffea import processor  # noqa: E402
from coffea.nanoevents import schemas  # noqa: E402
from coffea.processor.executor import UprootMissTreeError  # noqa: E402
from coffea.processor.test_items import NanoEventsProcessor  # noqa: E402

from raydag.coffea import RayExecutor  # noqa: E402

pytestmark = [pytest.mark.hep, pytest.mark.usefixtures("ray_cluster")]

SAMPLES = Path(__file__).parent / "samples"
IDS = ("run", "luminosityBlock", "event")  # NanoAOD's event id, which coffea requires
_exceptions = (FileNotFoundError, UprootMissTreeError, pyarrow.ArrowInvalid)


def _special_tree(source: Path, target: Path) -> None:
    """``source``'s event ids and muons, as NanoAOD names them (``nMuon``, ``Muon_pt``),
    under the tree name ``NotEvents``."""
    events = uproot.open(source)["Events"]
    arrays = events.arrays(filter_name=["Muon_*", *IDS])
    muons = {f[len("Muon_") :]: arrays[f] for f in arrays.fields if f.startswith("Muon_")}
    data = {**{k: arrays[k] for k in IDS}, "Muon": ak.zip(muons)}
    with uproot.recreate(target) as f:
        f.mktree(
            "NotEvents",
            {k: v.type.content for k, v in data.items()},
            counter_name=lambda counted: f"n{counted}",
            field_name=lambda outer, inner: f"{outer}_{inner}",
        )
        f["NotEvents"].extend(data)


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("samples")
    for name in ("nano_dy.root", "nano_dimuon.root"):
        shutil.copy(SAMPLES / name, where / name)
    _special_tree(where / "nano_dy.root", where / "nano_dy_SpecialTree.root")
    return where


def _cases() -> list:
    """coffea's grid (its ``executor`` axis with ``RayExecutor`` added), ROOT TTrees only,
    its ``ProcessorABC`` half (``Callable`` hands the executor the same function).
    ``FuturesExecutor``, the reference, on its eager cases without compression or
    ``maxchunks`` alone: each of its runs starts a process pool, and coffea's own CI
    runs the rest."""
    cases = []
    for mode in ("eager", "virtual"):
        for executor in (processor.FuturesExecutor, RayExecutor):
            for compression in (None, 0):
                for maxchunks in (None, 1000):
                    if executor is processor.FuturesExecutor and (
                        mode != "eager" or compression is not None or maxchunks is not None
                    ):
                        continue
                    for skip, name in ((False, "no"), (True, "yes"), (_exceptions, "types")):
                        cases.append(
                            pytest.param(
                                "ProcessorABC", mode, executor, compression, maxchunks, skip,
                                id=f"{mode}-{executor.__name__}-{compression}-{maxchunks}-{name}",
                            )
                        )  # fmt: skip
    return cases


@pytest.mark.filterwarnings("ignore:Skipping bad file")
@pytest.mark.filterwarnings("ignore:Missing cross-reference index")
@pytest.mark.filterwarnings("ignore:Branch .* already exists")
@pytest.mark.filterwarnings("ignore:Performed attempt")
@pytest.mark.parametrize(
    ("processor_type", "mode", "executor", "compression", "maxchunks", "skipbadfiles"), _cases()
)
def test_nanoevents_analysis(
    samples, processor_type, mode, executor, compression, maxchunks, skipbadfiles
):
    if processor_type == "Callable":
        processor_instance = NanoEventsProcessor(mode=mode, check_filehandle=True)
    else:
        processor_instance = NanoEventsProcessor(mode=mode, check_filehandle=True).process

    filelist = {
        "DummyBadMissingFile": {
            "treename": "Events",
            "files": [str(samples / "non_existent.root")],
        },
        "ZJetsBadMissingTree": {
            "treename": "NotEvents",
            "files": [str(samples / "nano_dy.root"), str(samples / "nano_dy_SpecialTree.root")],
        },
        "ZJetsBadMissingTreeAllFiles": {
            "treename": "NotEvents",
            "files": [str(samples / "nano_dy.root")],
        },
        "ZJets": {
            "treename": "Events",
            "files": [str(samples / "nano_dy.root")],
            "metadata": {"checkusermeta": True, "someusermeta": "hello"},
        },
        "Data": {
            "treename": "Events",
            "files": [str(samples / "nano_dimuon.root")],
            "metadata": {"checkusermeta": True, "someusermeta2": "world"},
        },
    }
    options = {"status": False} if executor is RayExecutor else {}
    run = processor.Runner(
        executor=executor(compression=compression, **options),
        skipbadfiles=skipbadfiles,
        schema=schemas.NanoAODSchema,
        maxchunks=maxchunks,
        format="root",
    )

    if skipbadfiles == _exceptions:
        hists = run(filelist, processor_instance=processor_instance, treename="Events")
        assert hists["cutflow"]["ZJets_pt"] == 18
        assert hists["cutflow"]["ZJets_mass"] == 6
        assert hists["cutflow"]["ZJetsBadMissingTree_pt"] == 18
        assert hists["cutflow"]["ZJetsBadMissingTree_mass"] == 6
        assert hists["cutflow"]["Data_pt"] == 84
        assert hists["cutflow"]["Data_mass"] == 66
    else:
        with pytest.raises(_exceptions):
            run(filelist, processor_instance=processor_instance, treename="Events")
        with pytest.raises(_exceptions):
            run(filelist, processor_instance=processor_instance, treename="NotEvents")
