"""One line per row of each named run folder of a b8 call: status, s/update, tokens/s, per-update times.

    python3 summarize.py OUT main1 prev1 ...
"""

import json
import sys
from pathlib import Path

out, names = Path(sys.argv[1]), sys.argv[2:]
for name in names:
    try:
        rows = json.loads((out / name / "results.json").read_text())["rows"]
    except (OSError, ValueError, KeyError) as err:
        print(name, "no results", type(err).__name__)
        continue
    for x in rows:
        print(name, x.get("status"), "s/update", x.get("s_per_update"), "tok/s", x.get("tokens_per_s"),
              "updates", x.get("update_times"), "score", x.get("score_times"), "gen", x.get("gen_times"),
              (x.get("error") or "")[:200])  # fmt: skip
