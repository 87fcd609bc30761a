#!/usr/bin/env python3
"""TLS cost, interleaved: for each round and each build, `ferry serve` on
loopback with the socket path forced, once in clear and once with
`--tls require`, and `ferry bench --peer` against it; prints the median
GB/s per point with the three values and the on/off ratio per build.

usage: scripts/bench-tls-cost.py ROUNDS LABEL=FERRY_BINARY [LABEL=FERRY_BINARY ...]
environment: OPS (write,read), BLOCKS (4KiB,64KiB,1MiB), DUR (500ms)."""
import json, subprocess, sys, statistics, os, time, re
rounds=int(sys.argv[1]); bins=[a.split('=',1) for a in sys.argv[2:]]
env=dict(os.environ, FERRY_SECRET='tls-bench')
def serve(binary, port, tls):
    args=[binary,'serve','--backend',f'tcp://127.0.0.1:{port}?same_host=off','--size','256MiB']+(['--tls','require'] if tls else [])
    p=subprocess.Popen(args,stdout=subprocess.PIPE,stderr=subprocess.DEVNULL,text=True,env=env)
    for line in p.stdout:
        m=re.search(r'--remote-addr (\S+)',line)
        if m: return p,m.group(1)
    raise SystemExit('no addr')
res={}
port=7300
for r in range(rounds):
    for label,b in bins:
        for tls in (False,True):
            port+=1
            p,addr=serve(b,port,tls)
            be='tcp://127.0.0.1:0?same_host=off'+('&tls=require' if tls else '')
            out=subprocess.run([b,'bench','--backend',be,'--peer',f'127.0.0.1:{port}','--remote-addr',addr,'--remote-len','256MiB','--ops',os.environ.get('OPS','write,read'),'--blocks',os.environ.get('BLOCKS','4KiB,64KiB,1MiB'),'--batches','1,16','--duration',os.environ.get('DUR','500ms'),'--no-baselines','--json'],capture_output=True,text=True,env=env,timeout=600)
            p.kill(); p.wait()
            try: data=json.loads(out.stdout)
            except Exception: print('FAIL',label,tls,out.stderr[-800:]); continue
            for d in data:
                assert d['verified']
                res.setdefault((label,tls),{}).setdefault((d['op'],d['block'],d['batch']),[]).append(d['gbps'])
keys=sorted({k for v in res.values() for k in v})
hdr='op block batch | '+' | '.join(f'{l} off | {l} on | on/off' for l,_ in bins)
print(hdr)
for k in keys:
    row=[]
    for l,_ in bins:
        off=res.get((l,False),{}).get(k,[]); on=res.get((l,True),{}).get(k,[])
        if not off or not on: row.append('-'); continue
        mo,mn=statistics.median(off),statistics.median(on)
        row.append('%.2f [%s] | %.2f [%s] | %.2f'%(mo,','.join('%.2f'%x for x in off),mn,','.join('%.2f'%x for x in on),mn/mo))
    print(k[0],k[1]>>10,'KiB',k[2],'|',' | '.join(row))
