"""Tiny copies of the public releases in their published layouts (file names, folders, CSV headers, value codes,
ID formats), built from the shared real images (NIH ChestX-ray14 sample, HAM10000 subset).

Layout facts are those the source loaders cite (``fedpartial/data/catalog/*/loader.py``).
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
from PIL import Image

from conftest import SHARED_DATA

SHARED = SHARED_DATA
NIH = SHARED / "nih_cxr14_1000"
HAM = SHARED / "ham10000"

NIH_ENTRY_HEADER = (
    "Image Index,Finding Labels,Follow-up #,Patient ID,Patient Age,Patient Gender,View Position,"
    "OriginalImage[Width,Height],OriginalImagePixelSpacing[x,y]"
)
CHEXPERT_HEADER = [
    "Path",
    "Sex",
    "Age",
    "Frontal/Lateral",
    "AP/PA",
    "No Finding",
    "Enlarged Cardiomediastinum",
    "Cardiomegaly",
    "Lung Opacity",
    "Lung Lesion",
    "Edema",
    "Consolidation",
    "Pneumonia",
    "Atelectasis",
    "Pneumothorax",
    "Pleural Effusion",
    "Pleural Other",
    "Fracture",
    "Support Devices",
]
MIMIC_LABELS = [
    "Atelectasis",
    "Cardiomegaly",
    "Consolidation",
    "Edema",
    "Enlarged Cardiomediastinum",
    "Fracture",
    "Lung Lesion",
    "Lung Opacity",
    "No Finding",
    "Pleural Effusion",
    "Pleural Other",
    "Pneumonia",
    "Pneumothorax",
    "Support Devices",
]
MIMIC_META = [
    "dicom_id",
    "subject_id",
    "study_id",
    "PerformedProcedureStepDescription",
    "ViewPosition",
    "Rows",
    "Columns",
    "StudyDate",
    "StudyTime",
    "ProcedureCodeSequence_CodeMeaning",
    "ViewCodeSequence_CodeMeaning",
    "PatientOrientationCodeSequence_CodeMeaning",
]
ISIC2019 = ["MEL", "NV", "BCC", "AK", "BKL", "DF", "VASC", "SCC", "UNK"]
HAM7 = ["MEL", "NV", "BCC", "AKIEC", "BKL", "DF", "VASC"]


def nih_sample(n: int) -> pd.DataFrame:
    """The first ``n`` rows of the shared NIH sample (labels.csv: Image Index, Patient ID, 14 0/1 columns)."""
    return pd.read_csv(NIH / "labels.csv", dtype={"Patient ID": str}).iloc[:n]


def _jpeg(src: Path, dest: Path, size: int = 32, mode: str = "L") -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with Image.open(src) as im:
        im.convert(mode).resize((size, size)).save(dest, "JPEG", quality=90)


def _write_gz(df: pd.DataFrame, path: Path) -> None:
    with gzip.open(path, "wt", newline="") as f:
        df.to_csv(f, index=False)


def nih_release(dest: Path, n: int = 40) -> Path:
    """``Data_Entry_2017.csv`` + ``images_001/images`` / ``images_002/images`` + the official split lists."""
    df = nih_sample(n)
    classes = list(df.columns[2:])
    rows, half = [], n // 2
    for i, r in df.iterrows():
        found = [c for c in classes if r[c] == 1]
        folder = dest / ("images_001" if i < half else "images_002") / "images"
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(NIH / "images" / r["Image Index"], folder / r["Image Index"])
        rows.append(
            f"{r['Image Index']},{'|'.join(found) or 'No Finding'},{i % 3},{r['Patient ID']},"
            f"{40 + i % 30},{'MF'[i % 2]},{'PA' if i % 3 else 'AP'},2500,2048,0.143,0.143"
        )
    (dest / "Data_Entry_2017.csv").write_text(NIH_ENTRY_HEADER + "\n" + "\n".join(rows) + "\n")
    pids = sorted(df["Patient ID"].unique())
    test_pids = set(pids[::3])
    test = df[df["Patient ID"].isin(test_pids)]["Image Index"]
    train = df[~df["Patient ID"].isin(test_pids)]["Image Index"]
    (dest / "train_val_list.txt").write_text("\n".join(train) + "\n")
    (dest / "test_list.txt").write_text("\n".join(test) + "\n")
    return dest


def chexpert_release(parent: Path, n_patients: int = 16, name: str = "CheXpert-v1.0-small", seed: int = 0) -> Path:
    """``<name>/train.csv`` + ``valid.csv`` + ``train/patientNNNNN/studyN/viewK_{frontal,lateral}.jpg`` (NIH
    chest X-rays as the pixels, CheXpert-labeler value codes as the labels)."""
    root = parent / name
    rng = np.random.default_rng(seed)
    nih = nih_sample(3 * n_patients + 6)
    k = 0
    rows = {"train": [], "valid": []}
    for split, count, first in (("train", n_patients, 1), ("valid", 3, 64541)):
        for p in range(first, first + count):
            views = [("view1_frontal.jpg", "Frontal", "AP" if p % 2 else "PA")]
            if p % 3 == 0:
                views.append(("view2_lateral.jpg", "Lateral", ""))
            for file, fl, ap in views:
                rel = f"{split}/patient{p:05d}/study1/{file}"
                _jpeg(NIH / "images" / nih["Image Index"].iloc[k % len(nih)], root / rel)
                k += 1
                cells = rng.choice(["1.0", "0.0", "-1.0", ""], size=14, p=[0.3, 0.25, 0.2, 0.25])
                if split == "valid":
                    cells = rng.choice(["1.0", "0.0"], size=14)
                cells[0] = "" if p % 5 else "1.0"  # No Finding
                rows[split].append([f"{name}/{rel}", "Female" if p % 2 else "Male", str(50 + p % 30), fl, ap, *cells])
    for split, file in (("train", "train.csv"), ("valid", "valid.csv")):
        pd.DataFrame(rows[split], columns=CHEXPERT_HEADER).to_csv(root / file, index=False)
    return root


def _dicom_id(rng: np.random.Generator) -> str:
    return "-".join("".join(rng.choice(list("0123456789abcdef"), 8)) for _ in range(5))


def mimic_release(dest: Path, n_subjects: int = 12, seed: int = 0) -> Path:
    """``mimic-cxr-2.0.0-{chexpert,metadata,split}.csv.gz`` + ``files/p10/p100000NN/sNNNNNNNN/<dicom_id>.jpg``."""
    rng = np.random.default_rng(seed)
    nih = nih_sample(4 * n_subjects)
    labels, meta, split = [], [], []
    k = 0
    for s in range(n_subjects):
        subject = 10000032 + 17 * s
        which = "test" if s % 4 == 0 else "validate" if s % 4 == 1 else "train"
        for st in range(1 + s % 2):
            study = 50414267 + 1000 * s + st
            cells = rng.choice(["1.0", "0.0", "-1.0", ""], size=14, p=[0.3, 0.3, 0.15, 0.25])
            labels.append([str(subject), str(study), *cells])
            for view in ["PA", "LATERAL"] if st == 0 else ["AP"]:
                d = _dicom_id(rng)
                _jpeg(
                    NIH / "images" / nih["Image Index"].iloc[k % len(nih)],
                    dest / f"files/p{str(subject)[:2]}/p{subject}/s{study}/{d}.jpg",
                )
                k += 1
                meta.append(
                    [
                        d,
                        str(subject),
                        str(study),
                        "CHEST (PA AND LAT)",
                        view,
                        "3056",
                        "2544",
                        "21800506",
                        "213014.531",
                        "CHEST (PA AND LAT)",
                        "postero-anterior",
                        "Erect",
                    ]
                )
                split.append([d, str(study), str(subject), which])
    _write_gz(
        pd.DataFrame(labels, columns=["subject_id", "study_id", *MIMIC_LABELS]),
        dest / "mimic-cxr-2.0.0-chexpert.csv.gz",
    )
    _write_gz(pd.DataFrame(meta, columns=MIMIC_META), dest / "mimic-cxr-2.0.0-metadata.csv.gz")
    _write_gz(
        pd.DataFrame(split, columns=["dicom_id", "study_id", "subject_id", "split"]),
        dest / "mimic-cxr-2.0.0-split.csv.gz",
    )
    return dest


def ham_sample(n: int, offset: int = 0) -> pd.DataFrame:
    """``n`` rows of the shared HAM10000 metadata cycling through the classes (every class present)."""
    meta = pd.read_csv(HAM / "HAM10000_metadata.csv")
    groups = [g.iloc[offset:] for _, g in meta.groupby("dx")]
    rows = []
    i = 0
    while len(rows) < n:
        g = groups[i % len(groups)]
        j = i // len(groups)
        if j < len(g):
            rows.append(g.iloc[j])
        i += 1
    return pd.DataFrame(rows).reset_index(drop=True)


ISIC2019_CENTRES = {
    "BCN": "BCN",
    "HAM_vidir_molemax": "HAM",
    "HAM_vidir_modern": "HAM",
    "HAM_rosendahl": "HAM",
    "MSK": "MSK",
    "HAM_vienna_dias": "HAM",
}


def isic2019_release(
    dest: Path, per_centre: int = 6, unknown_centre: int = 2, centres: list[str] | None = None
) -> Path:
    """``ISIC_2019_Training_GroundTruth.csv`` (one-hot 0.0 / 1.0 over 9 columns), ``ISIC_2019_Training_Metadata.csv``
    (blank lesion_id where the centre is unknown), ``ISIC_2019_Training_Input/*.jpg`` and a HAM10000 metadata with
    FLamby's ``dataset`` column (``HAM10000_metadata``); ``centres``: a subset of the six."""
    chosen = list(centres or ISIC2019_CENTRES)
    n = per_centre * len(chosen) + unknown_centre
    ham = ham_sample(n)
    dx_map = {"mel": "MEL", "nv": "NV", "bcc": "BCC", "akiec": "AK", "bkl": "BKL", "df": "DF", "vasc": "VASC"}
    gt, meta, hamrows = [], [], []
    for i, r in ham.iterrows():
        c = i // per_centre
        centre = chosen[c] if c < len(chosen) else None
        image = r["image_id"] + ("_downsampled" if centre == "MSK" else "")
        cls = "SCC" if i % 7 == 6 else dx_map[r["dx"]]
        gt.append([image, *["1.0" if k == cls else "0.0" for k in ISIC2019]])
        code = ISIC2019_CENTRES.get(centre) if centre else None
        lesion = "" if code is None else (f"MSK4_{i:07d}" if code == "MSK" else f"{code}_{i // 2:07d}")
        meta.append([image, "55.0", "anterior torso", lesion, "male"])
        if code == "HAM":
            hamrows.append([lesion, image, r["dx"], "histo", "55.0", "male", "back", centre[4:]])
        _jpeg(HAM / "images" / f"{r['image_id']}.jpg", dest / "ISIC_2019_Training_Input" / f"{image}.jpg", mode="RGB")
    pd.DataFrame(gt, columns=["image", *ISIC2019]).to_csv(dest / "ISIC_2019_Training_GroundTruth.csv", index=False)
    pd.DataFrame(meta, columns=["image", "age_approx", "anatom_site_general", "lesion_id", "sex"]).to_csv(
        dest / "ISIC_2019_Training_Metadata.csv", index=False
    )
    pd.DataFrame(
        hamrows, columns=["lesion_id", "image_id", "dx", "dx_type", "age", "sex", "localization", "dataset"]
    ).to_csv(dest / "HAM10000_metadata", index=False)
    return dest


def isic2018_release(dest: Path, n: int = 28, groupings: bool = True) -> Path:
    """``ISIC2018_Task3_Training_Input/*.jpg``, ``ISIC2018_Task3_Training_GroundTruth/
    ISIC2018_Task3_Training_GroundTruth.csv`` and ``ISIC2018_Task3_Training_LesionGroupings.csv``."""
    ham = ham_sample(n)
    gt = pd.DataFrame({"image": ham["image_id"]})
    for c in HAM7:
        gt[c] = (ham["dx"] == c.lower()).astype(float)
    (dest / "ISIC2018_Task3_Training_GroundTruth").mkdir(parents=True, exist_ok=True)
    gt.to_csv(dest / "ISIC2018_Task3_Training_GroundTruth/ISIC2018_Task3_Training_GroundTruth.csv", index=False)
    lesions = [f"HAM_{i // 2:07d}" for i in range(n)]  # two images per lesion
    if groupings:
        pd.DataFrame(
            {"image": ham["image_id"], "lesion_id": lesions, "diagnosis_confirm_type": "histopathology"}
        ).to_csv(dest / "ISIC2018_Task3_Training_LesionGroupings.csv", index=False)
    for i in ham["image_id"]:
        _jpeg(HAM / "images" / f"{i}.jpg", dest / "ISIC2018_Task3_Training_Input" / f"{i}.jpg", mode="RGB")
    return dest


def ham10000_release(dest: Path, n: int = 28) -> Path:
    """``HAM10000_metadata.csv`` + ``HAM10000_images_part_1/`` and ``_part_2/``."""
    ham = ham_sample(n)
    for i, image in enumerate(ham["image_id"]):
        part = "HAM10000_images_part_1" if i % 2 else "HAM10000_images_part_2"
        _jpeg(HAM / "images" / f"{image}.jpg", dest / part / f"{image}.jpg", mode="RGB")
    ham.to_csv(dest / "HAM10000_metadata.csv", index=False)
    return dest
