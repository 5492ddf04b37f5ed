"""bitsandbytes' wheel repacked with only the libraries the GPU image can load (libbitsandbytes_cpu.so and the
CUDA 13 builds: torch 2.11 there is cu130), RECORD rewritten: 41 MiB -> ~7 MiB, so that it fits a call's carry.

    python3 tools/gpu/slim_bnb.py bitsandbytes-0.50.2-....whl   # in place
"""
import base64, hashlib, os, re, sys, zipfile
src = sys.argv[1]
keep = re.compile(r"bitsandbytes/libbitsandbytes_(cpu|cuda13\d)\.so$")
tmp = src + ".slim"
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
    names = [n for n in zin.namelist() if not (n.startswith("bitsandbytes/libbitsandbytes_") and not keep.search(n))]
    record_name = next(n for n in names if n.endswith(".dist-info/RECORD"))
    rows = []
    for n in names:
        if n == record_name:
            continue
        data = zin.read(n)
        zout.writestr(zin.getinfo(n), data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{n},sha256={digest},{len(data)}")
    rows.append(f"{record_name},,")
    zout.writestr(record_name, "\n".join(rows) + "\n")
os.replace(tmp, src)
print("slimmed", os.path.basename(src), os.path.getsize(src), "bytes")
