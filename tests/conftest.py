import pytest
from multirank import Ranks


@pytest.fixture(scope="session")
def ranks():
    """Reusable rank pools: ``ranks.run(tp_size, fn, *args)`` runs ``fn`` on every rank (multirank.py)."""
    pools = Ranks()
    yield pools
    pools.close()
