import sys; import os; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common, numpy as np
common.data, common.meta = common.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), '../../../shared/') + 'fixtures/smollm2-gpl3-2048.safetensors')
from common import *
layers=list(range(30))
def exact(K,L):
    return lambda h,q: K[:,h]@q
# exact topk mass without sinks
data=common.data
ms=[]; ms2=[]
for L in layers:
    K=data[f'k.{L}'];Q=data[f'q.{L}']
    for i in range(0,64,4):
        p=1984+i
        for h in range(9):
            ex=K[:p+1,h//3]@Q[i,h]; w=np.exp((ex-ex.max())/8); w/=w.sum()
            t=np.argpartition(-ex,409)[:410]; ms.append(w[t].sum())
print('exact topk mass', np.mean(ms))
print('exact with sinks', evaluate(layers, exact, every=4))
