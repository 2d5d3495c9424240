"""Ray job entry: start the named raygraph coordinator on the cluster and leave it serving.

    ray job submit --address http://HEAD:8265 --working-dir . -- \
        python deploy/job.py --model /path/to/checkpoint --tp 2

Any `raygraph serve` flag may follow. The coordinator is detached, so it keeps serving
after this job returns; clients reach it by name (deploy/client.py), `raygraph stop` ends it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from raygraph.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["serve", "--address", "auto", "--detach", *sys.argv[1:]]))
