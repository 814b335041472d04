"""Floods a running `accel launch` job's rendezvous store with 1100 idle connections (docs/design/rendezvous.md).

Usage: python3 scripts/flood_store.py LAUNCHER_PID
Finds the store port in a rank's environment (MASTER_PORT), opens the connections, prints the launcher's CPU
share over the next 5 s and how fast a new stray is answered, then holds the connections 30 s more.
"""
import os, socket, sys, time, re, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
launcher = int(sys.argv[1])
# Find a rank's MASTER_PORT.
port = None
for _ in range(600):
    for pid in os.listdir('/proc'):
        if not pid.isdigit(): continue
        try:
            if int(open(f'/proc/{pid}/stat').read().split(')')[1].split()[1]) != launcher: continue
            env = open(f'/proc/{pid}/environ','rb').read().split(b'\0')
        except Exception: continue
        for e in env:
            if e.startswith(b'MASTER_PORT='): port = int(e.split(b'=')[1])
    if port: break
    time.sleep(0.05)
print("store port", port, flush=True)
def cpu(pid):
    f = open(f'/proc/{pid}/stat').read().split(')')[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf('SC_CLK_TCK')
socks = []
for i in range(1100):
    try:
        s = socket.create_connection(('127.0.0.1', port), timeout=2); socks.append(s)
    except Exception as e:
        pass
print("strays connected", len(socks), flush=True)
c0, t0 = cpu(launcher), time.time()
time.sleep(5)
c1, t1 = cpu(launcher), time.time()
print(f"launcher CPU during the flood: {100*(c1-c0)/(t1-t0):.1f}%", flush=True)
# A fresh unauthenticated client still gets an answer (a refusal) quickly.
t = time.time(); s = socket.create_connection(('127.0.0.1', port), timeout=2)
s.sendall(b'\x0c\x00\x00\x00GARBAGE!xxxx'); s.settimeout(2)
try: r = s.recv(100)
except Exception as e: r = repr(e)
print(f"a new stray got {r!r} after {1000*(time.time()-t):.1f} ms", flush=True)
time.sleep(30)
