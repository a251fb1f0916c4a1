import sys; import os; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common, numpy as np, time
common.data, common.meta = common.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), '../../../shared/') + 'fixtures/smollm2-gpl3-2048.safetensors')
from common import *
src=open('exp3.py').read(); exec(src[src.index("def rq_refine"):src.index("layers=list")])
layers=list(range(30))
E=lambda name,fn: print(name, *['%.4f'%v for v in evaluate(layers, fn, every=8)], flush=True)
w=sys.argv[1]
if w=='a': E('rq66 it8 icm1', rq_refine(iters=8,rounds=1))
if w=='b': E('rq66 it8 icm0', rq_refine(iters=8,rounds=0))
if w=='c': E('rq66 it4 icm2', rq_refine(iters=4,rounds=2))
if w=='d': E('rq66 it12 icm2', rq_refine(iters=12,rounds=2))
