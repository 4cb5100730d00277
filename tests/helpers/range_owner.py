"""A HIXL-style target in its own process: one malloc_mem pool, ranges registered inside it.

    python range_owner.py 127.0.0.1:PORT POOL_BYTES [FABRIC]

Prints one JSON line {"engine", "pool", "pid"} once serving, then answers one JSON line
per JSON command on stdin, through the `Hixl` facade (status codes, as HIXL users see):

    {"do": "register", "offset": O, "length": L}  -> {"ret": code, "addr": pool + O}
    {"do": "deregister", "offset": O}             -> {"ret": code}  (the handle of that range)
    {"do": "fill", "offset": O, "length": L, "byte": B}      -> {}
    {"do": "digest", "offset": O, "length": L}    -> {"sha256": of the pool's bytes there}
    {"do": "malloc", "size": N}                    -> {"ret": code, "addr": A}
    {"do": "free", "addr": A}                      -> {"ret": code, "error": last error text}
    {"do": "register_plain", "length": L}          -> {"ret": code, "addr": A} (a bytearray)

A register/deregister of a range the engine refuses answers its code and the error text.
stdin closing finalizes the engine.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import sys

import hixl
from hixl import Hixl, MemDesc, MemType


def main() -> None:
    name, pool_bytes = sys.argv[1], int(sys.argv[2])
    fabric = sys.argv[3] if len(sys.argv) > 3 else "1"
    engine = Hixl()
    assert engine.initialize(name, {hixl.OPTION_ENABLE_USE_FABRIC_MEM: fabric}) == hixl.SUCCESS
    ret, pool = engine.malloc_mem(MemType.MEM_HOST, pool_bytes)
    assert ret == hixl.SUCCESS
    handles: dict[int, object] = {}
    keep: list[bytearray] = []
    print(json.dumps({"engine": name, "pool": pool, "pid": __import__("os").getpid()}),
          flush=True)
    for line in sys.stdin:
        step = json.loads(line)
        do = step["do"]
        reply: dict[str, object] = {}
        if do == "register":
            addr = pool + step["offset"]
            ret, handle = engine.register_mem(MemDesc(addr, step["length"]), MemType.MEM_HOST)
            if ret == hixl.SUCCESS:
                handles[step["offset"]] = handle
            reply = {"ret": ret, "addr": addr}
        elif do == "deregister":
            handle = handles.get(step["offset"])
            ret = engine.deregister_mem(handle) if handle is not None else hixl.PARAM_INVALID
            reply = {"ret": ret}
        elif do == "fill":
            ctypes.memset(pool + step["offset"], step["byte"], step["length"])
        elif do == "digest":
            data = ctypes.string_at(pool + step["offset"], step["length"])
            reply = {"sha256": hashlib.sha256(data).hexdigest()}
        elif do == "malloc":
            ret, addr = engine.malloc_mem(MemType.MEM_HOST, step["size"])
            reply = {"ret": ret, "addr": addr}
        elif do == "free":
            reply = {"ret": engine.free_mem(step["addr"])}
        elif do == "register_plain":
            plain = bytearray(step["length"])
            keep.append(plain)
            addr = ctypes.addressof(ctypes.c_char.from_buffer(plain))
            ret, _ = engine.register_mem(MemDesc(addr, len(plain)), MemType.MEM_HOST)
            reply = {"ret": ret, "addr": addr}
        if reply.get("ret", hixl.SUCCESS) != hixl.SUCCESS:
            reply["error"] = str(engine.last_error)
        print(json.dumps(reply), flush=True)
    engine.finalize()


if __name__ == "__main__":
    main()
