import sys; import os; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common, numpy as np, time
common.data, common.meta = common.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), '../../../shared/') + 'fixtures/smollm2-gpl3-2048.safetensors')
from common import *
exec(open('exp1.py').read().split("P=lambda")[0].split("from common import *")[1])
prof,_ = load(os.path.join(os.path.dirname(os.path.abspath(__file__)), '../../../shared/') + 'fixtures/smollm2-gpl2-1024.safetensors')
def qdiag(L,h,pair=True):
    Q=prof[f'q.{L}'][:,3*h:3*h+3].reshape(-1,64); w=(Q**2).mean(0)
    if pair: w=np.tile((w[:32]+w[32:])/2,2)
    return w/w.mean()
def qcov(L,h,reg=0.1):
    Q=prof[f'q.{L}'][:,3*h:3*h+3].reshape(-1,64); S=Q.T@Q/len(Q); S/= np.trace(S)/64
    S=S+reg*np.eye(64); e,V=np.linalg.eigh(S); return V@np.diag(np.sqrt(e))@V.T
def rqw(stages_bits, iters=20, wfn=None, cov=None):
    def f(K,L):
        T,H,D=K.shape; tabs=[]
        for h in range(H):
            if cov is not None: M=cov(L,h)
            elif wfn is not None: M=np.diag(np.sqrt(wfn(L,h)))
            else: M=np.eye(D)
            Mi=np.linalg.inv(M)
            r=K[:,h]@M; rng=np.random.default_rng(L*10+h); st=[]
            for b in stages_bits:
                c,a=kmeans(r,2**b,iters,rng); st.append((c@Mi,a)); r=r-c[a]
            tabs.append(st)
        return lambda h,q: sum((c@q)[a] for c,a in tabs[h])
    return f
layers=list(range(30))
E=lambda name,fn: print(name, *['%.4f'%v for v in evaluate(layers, fn, every=8)], flush=True)
which=sys.argv[1:]
if 'a' in which:
  E('rq 4+4+4', rq([4,4,4]))
  E('rq 6+6 qdiag', rqw([6,6], wfn=qdiag))
if 'b' in which:
  E('rq 6+6 qcov', rqw([6,6], cov=qcov))
  E('pq pairs qdiag', gpq([P(range(16)),P(range(16,32))],[6,6], weight=qdiag))
