import sys; import os; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common, numpy as np, time
common.data, common.meta = common.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), '../../../shared/') + 'fixtures/smollm2-gpl3-2048.safetensors')
from common import *
def gpq(groups, bits, iters=20, weight=None):
    # groups: list of index arrays; bits per group
    def f(K,L):
        T,H,D=K.shape; tabs=[]
        for h in range(H):
            x=K[:,h]; w = np.ones(D) if weight is None else weight(L,h)
            sw=np.sqrt(w); rng=np.random.default_rng(L*10+h); cs=[]
            for g,b in zip(groups,bits):
                c,a=kmeans(x[:,g]*sw[g], 2**b, iters, rng); cs.append((c/sw[g], a))
            tabs.append(cs)
        def s(h,q):
            return sum((c@q[g])[a] for (c,a),g in zip(tabs[h],groups))
        return s
    return f
def rq(stages_bits, iters=20):
    def f(K,L):
        T,H,D=K.shape; tabs=[]
        for h in range(H):
            r=K[:,h].copy(); rng=np.random.default_rng(L*10+h); st=[]
            for b in stages_bits:
                c,a=kmeans(r,2**b,iters,rng); st.append((c,a)); r=r-c[a]
            tabs.append(st)
        return lambda h,q: sum((c@q)[a] for c,a in tabs[h])
    return f
P=lambda js: np.array(list(js)+[j+32 for j in js])
layers=list(range(30))
E=lambda name,fn: print(name, *['%.4f'%v for v in evaluate(layers, fn, every=8)], flush=True)
nat=[np.arange(0,32),np.arange(32,64)]
which=sys.argv[1:]
if 'a' in which:
  E('m2b6 natural', gpq(nat,[6,6]))
  E('m2b6 pairs lo/hi', gpq([P(range(16)),P(range(16,32))],[6,6]))
  E('m2b6 pairs even/odd', gpq([P(range(0,32,2)),P(range(1,32,2))],[6,6]))
if 'b' in which:
  E('m4b3 pairs', gpq([P(range(i*8,i*8+8)) for i in range(4)],[3]*4))
  E('m3b4 pairs 11/11/10', gpq([P(range(0,11)),P(range(11,22)),P(range(22,32))],[4]*3))
  E('rq 6+6', rq([6,6]))
if 'c' in which:
  E('m2 pairs lo20/hi12 b6', gpq([P(range(20)),P(range(20,32))],[6,6]))
  E('m2 pairs lo24/hi8 b5/7', gpq([P(range(24)),P(range(24,32))],[5,7]))
  E('m2 pairs lo16/hi16 b5/7', gpq([P(range(16)),P(range(16,32))],[5,7]))
