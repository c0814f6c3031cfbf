"""Write the tabular example's CSV: scikit-learn's breast-cancer table as a hospital would export it
(a patient id, 30 measurements in their own units, a text diagnosis). Nothing is downloaded.

    .venv/bin/python examples/tabular-csv-dwfed/make_data.py [--out DIR]
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from sklearn.datasets import load_breast_cancer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "data"))
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    bunch = load_breast_cancer()
    columns = [name.replace(" ", "_") for name in bunch.feature_names]
    with open(out / "patients.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["patient_id", *columns, "diagnosis"])
        for i, (row, target) in enumerate(zip(bunch.data, bunch.target)):
            writer.writerow([f"P{i:04d}", *(f"{v:.6g}" for v in row), bunch.target_names[target]])
    print(f"wrote {out / 'patients.csv'} ({len(bunch.target)} patients, {len(columns)} measurements)")


if __name__ == "__main__":
    main()
