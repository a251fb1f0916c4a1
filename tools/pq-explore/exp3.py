import sys; import os; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common, numpy as np, time
common.data, common.meta = common.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), '../../../shared/') + 'fixtures/smollm2-gpl3-2048.safetensors')
from common import *
def rq_refine(bits=(6,6), iters=20, rounds=3, eta=1.0):
    def f(K,L):
        T,H,D=K.shape; tabs=[]
        for h in range(H):
            X=K[:,h]; rng=np.random.default_rng(L*10+h)
            r=X.copy(); Cs=[]; As=[]
            for b in bits:
                c,a=kmeans(r,2**b,iters,rng); Cs.append(c); As.append(a); r=r-c[a]
            xh = X/np.maximum(np.linalg.norm(X,axis=1,keepdims=True),1e-9)
            for _ in range(rounds):
                # ICM re-assign each stage given others, anisotropic loss
                for s in range(len(bits)):
                    other = sum(Cs[t][As[t]] for t in range(len(bits)) if t!=s)
                    R = X-other  # want c close to R
                    # loss(c) = ||R-c||^2 + (eta-1)*((R-c).xh)^2
                    d = (R**2).sum(1)[:,None]-2*R@Cs[s].T+(Cs[s]**2).sum(1)[None]
                    if eta!=1.0:
                        pr = (R*xh).sum(1)[:,None] - xh@Cs[s].T
                        d = d + (eta-1)*pr**2
                    As[s]=d.argmin(1)
                # joint least squares codebook update (isotropic) or per-stage anisotropic
                for s in range(len(bits)):
                    other = sum(Cs[t][As[t]] for t in range(len(bits)) if t!=s)
                    R=X-other
                    for j in range(2**bits[s]):
                        m=As[s]==j
                        if not m.any(): continue
                        if eta==1.0: Cs[s][j]=R[m].mean(0)
                        else:
                            xm=xh[m]; W=m.sum()*np.eye(D)+(eta-1)*xm.T@xm
                            rhs=R[m].sum(0)+(eta-1)*xm.T@((R[m]*xm).sum(1))
                            Cs[s][j]=np.linalg.solve(W,rhs)
            tabs.append(list(zip(Cs,As)))
        return lambda h,q: sum((c@q)[a] for c,a in tabs[h])
    return f
layers=list(range(30))
E=lambda name,fn: print(name, *['%.4f'%v for v in evaluate(layers, fn, every=8)], flush=True)
w=sys.argv[1]
if w=='a': E('rq66 icm3', rq_refine())
if w=='b': E('rq66 icm3 eta2', rq_refine(eta=2.0))
if w=='c': E('rq66 icm3 eta4', rq_refine(eta=4.0))
if w=='d': E('rq57 icm3', rq_refine(bits=(5,7)))
