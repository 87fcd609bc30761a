#!/usr/bin/env python3
"""CPU per byte of the socket path, interleaved: for each round, point and
build, `ferry serve` on loopback with the socket path forced (with
`--tls require` unless TLS=0) and one `ferry bench --peer` point at batch
16 moving TOTAL bytes; prints the median GB/s and the CPU-s per GB moved of
the initiator (the bench's rusage) and the target (/proc of serve). The
CPU includes the warm-up (200 ms) and the read-back, so per-GB figures are
a little high, the same for every build.

usage: scripts/bench-tls-cpu.py ROUNDS OP:BLOCK[,OP:BLOCK...] LABEL=FERRY_BINARY [...]
environment: TLS (1), TOTAL (2GiB)."""
import os,sys,re,json,subprocess,statistics,resource
rounds=int(sys.argv[1]); points=[p.split(':') for p in sys.argv[2].split(',')]; bins=[a.split('=',1) for a in sys.argv[3:]]
env=dict(os.environ,FERRY_SECRET='tls-bench'); tls=os.environ.get('TLS','1')=='1'; total=os.environ.get('TOTAL','2GiB')
tck=os.sysconf('SC_CLK_TCK')
def cpu(pid):
    f=open(f'/proc/{pid}/stat').read().rsplit(')',1)[1].split(); return (int(f[11])+int(f[12]))/tck
res={}; port=7900
for r in range(rounds):
  for op,blk in points:
    for label,b in bins:
        port+=1
        p=subprocess.Popen([b,'serve','--backend',f'tcp://127.0.0.1:{port}?same_host=off','--size','256MiB']+(['--tls','require'] if tls else []),stdout=subprocess.PIPE,stderr=subprocess.DEVNULL,text=True,env=env)
        for line in p.stdout:
            m=re.search(r'--remote-addr (\S+)',line)
            if m: addr=m.group(1); break
        c0=cpu(p.pid)
        be='tcp://127.0.0.1:0?same_host=off'+('&tls=require' if tls else '')
        ru0=resource.getrusage(resource.RUSAGE_CHILDREN)
        q=subprocess.Popen([b,'bench','--backend',be,'--peer',f'127.0.0.1:{port}','--remote-addr',addr,'--remote-len','256MiB','--ops',op,'--blocks',blk,'--batches','16','--duration','20s','--total',total,'--warmup','200ms','--no-baselines','--json'],stdout=subprocess.PIPE,stderr=subprocess.PIPE,text=True,env=env)
        out,err=q.communicate()
        ru1=resource.getrusage(resource.RUSAGE_CHILDREN)
        cb=(ru1.ru_utime+ru1.ru_stime)-(ru0.ru_utime+ru0.ru_stime)
        c1=cpu(p.pid); p.kill(); p.wait()
        try: d=json.loads(out)[0]
        except Exception: print('FAIL',label,err[-500:]); continue
        res.setdefault((op,blk,label),[]).append((d['gbps'],c1-c0,d,cb))
def size(b):
    m=re.match(r'(\d+)(KiB|MiB)',b); return int(m.group(1))<<(10 if m.group(2)=='KiB' else 20)
print('GB/s median [values] | CPU-s per GB moved, median: initiator + target = total (warm-up and read-back included)')
for op,blk in points:
    for label,_ in bins:
        v=res.get((op,blk,label),[])
        if not v: continue
        g=[x[0] for x in v]
        per=[(x[3]/(x[2]['batches_measured']*16*size(blk)/1e9), x[1]/(x[2]['batches_measured']*16*size(blk)/1e9)) for x in v]
        ini=statistics.median([a for a,b in per]); tgt=statistics.median([b for a,b in per]); tot=statistics.median([a+b for a,b in per])
        print(f"{op} {blk} x16 {label}: {statistics.median(g):.2f} [{','.join('%.2f'%x for x in g)}] | {ini:.2f} + {tgt:.2f} = {tot:.2f} [{','.join('%.2f'%(a+b) for a,b in per)}]")
