"""Profile two data-parallel steps of the MLP into argv[1] (tests/distributed/test_profile.py):
each rank writes trace-rank{R}.json."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from models import make  # noqa: E402

import raf_dist  # noqa: E402
from raf_dist import distributed as dist  # noqa: E402

dist.get_config().enable_data_parallel = True
rank = dist.get_communicator().rank
module, x, y = make("mlp", 16)
mine = slice(8 * rank, 8 * rank + 8)  # this rank's rows of the global batch
trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x[mine],)),
                           optimizer=raf_dist.optim.SGD(lr=0.1))
x, y = x[mine].numpy(), y[mine].numpy()
trainer.profile(2, sys.argv[1])
for _ in range(3):  # the third step is not recorded
    trainer.step(x, y)
print(f"PROFILED rank {rank}")
