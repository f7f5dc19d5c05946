"""torch models in checkpoints under mpiexec: a refusal names its cause on every rank."""

import pytest

from tensorplay_mpi import checkpoint
from tensorplay_mpi.testing import assert_all, raises_everywhere

torch = pytest.importorskip("torch")


@pytest.mark.mpi(min_size=1)
def test_a_refused_manifest_names_its_cause_on_every_rank(comm, tmp_path_factory):
    """A bfloat16 tensor among the extras (saved from rank 0) is refused on every rank, naming
    the dtype or the manifest, not "optimizer shards" (there is no ZeRO here)."""
    directory = comm.bcast(str(tmp_path_factory.mktemp("ckpt")) if comm.rank == 0 else None)
    model = torch.nn.Linear(3, 2)
    extra = {"bad": torch.zeros(2, dtype=torch.bfloat16)}
    with raises_everywhere(TypeError, match="(?i)bfloat16|the manifest's contents") as raised:
        checkpoint.save(directory, model.parameters(), extra=extra, comm=comm)
    text = str(raised.value)
    assert_all("optimizer shards" not in text, text)
    assert_all(comm.rank != 0 or "bfloat16" in text.lower(), text)
