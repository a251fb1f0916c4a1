import sys; import os; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common, numpy as np
common.data, common.meta = common.load('/work/shared/fixtures/smollm2-gpl3-2048.safetensors') if False else common.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), '../../../shared/') + 'fixtures/smollm2-gpl3-2048.safetensors')
from common import *
def pq(m,b,perm=None,iters=20):
    def f(K,L):
        T,H,D = K.shape
        tabs=[]
        for h in range(H):
            x = K[:,h] if perm is None else K[:,h][:,perm]
            sd=D//m; cs=[];codes=[]
            rng=np.random.default_rng(L*10+h)
            for j in range(m):
                c,a = kmeans(x[:,j*sd:(j+1)*sd], 2**b, iters, rng); cs.append(c); codes.append(a)
            tabs.append((cs,codes))
        def s(h,q):
            cs,codes = tabs[h]; qq = q if perm is None else q[perm]; sd=D//m
            return sum((cs[j]@qq[j*sd:(j+1)*sd])[codes[j]] for j in range(m))
        return s
    return f
layers=[0,5,10,15,20,25,29]
import time
t=time.time()
print('m2b6', evaluate(layers, pq(2,6), every=4), time.time()-t)
perm = np.array([j for s in range(2) for j in list(range(s*16,(s+1)*16))+list(range(32+s*16,32+(s+1)*16))])
print('m2b6 ropepairs', evaluate(layers, pq(2,6,perm), every=4))
