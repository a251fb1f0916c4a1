import json, struct, numpy as np
def load(path):
    with open(path,'rb') as f:
        n = struct.unpack('<Q', f.read(8))[0]
        hdr = json.loads(f.read(n)); base = 8+n
        data = f.read()
    meta = hdr.pop('__metadata__', {})
    out = {}
    for k,v in hdr.items():
        dt = {'F16':np.float16,'F32':np.float32,'BF16':None}[v['dtype']]
        a,b = v['data_offsets']
        out[k] = np.frombuffer(data[a:b], dtype=dt).reshape(v['shape']).astype(np.float32)
    return out, meta

def kmeans(x, k, iters, rng):
    n = x.shape[0]
    # kmeans++
    c = [x[rng.integers(n)]]
    d2 = ((x - c[0])**2).sum(1)
    for _ in range(1,k):
        p = d2 / d2.sum() if d2.sum()>0 else np.ones(n)/n
        i = rng.choice(n, p=p); c.append(x[i])
        d2 = np.minimum(d2, ((x-x[i])**2).sum(1))
    c = np.array(c)
    for _ in range(iters):
        d = (x**2).sum(1)[:,None] - 2*x@c.T + (c**2).sum(1)[None]
        a = d.argmin(1)
        for j in range(k):
            m = a==j
            if m.any(): c[j] = x[m].mean(0)
    d = (x**2).sum(1)[:,None] - 2*x@c.T + (c**2).sum(1)[None]
    return c, d.argmin(1)

def evaluate(layers, approx_fn, T=2048, k=None, n_init=4, n_local=64, kfrac=5, every=1):
    """approx_fn(K [T,H,D], layer) -> function(hkv, q[D]) -> approx scores over T"""
    rec=[]; mass=[]; rec10=[]
    for L in layers:
        K = data[f'k.{L}']; Q = data[f'q.{L}']
        q0 = int(meta.get('q_start', K.shape[0]-Q.shape[0]))
        sc = approx_fn(K, L)
        for i in range(0, Q.shape[0], every):
            p = q0+i
            for h in range(Q.shape[1]):
                hk = h//3
                q = Q[i,h]
                ex = K[:p+1,hk]@q
                ap = sc(hk, q)[:p+1]
                for kf, store in ((kfrac, rec), (10, rec10)):
                    kk = K.shape[0]//kf
                    et = np.argpartition(-ex, kk-1)[:kk]
                    at = np.argpartition(-ap, kk-1)[:kk]
                    store.append(len(np.intersect1d(et,at))/kk)
                kk = K.shape[0]//kfrac
                w = np.exp((ex-ex.max())/8); w/=w.sum()
                sel = np.zeros(p+1,bool); sel[:n_init]=True; sel[p+1-n_local:]=True
                rest = np.where(~sel)[0]
                top = rest[np.argpartition(-ap[rest], kk-1)[:kk]]
                sel[top]=True
                mass.append(w[sel].sum())
    return np.mean(rec), np.mean(mass), np.mean(rec10)

def evaluate2(layers, approx_fn, every=4, kfrac=5):
    """mass with PQ top-k over all tokens, union sinks/recent"""
    mass=[]; mass_rest=[]
    for L in layers:
        K = data[f'k.{L}']; Q = data[f'q.{L}']
        sc = approx_fn(K, L)
        for i in range(0, Q.shape[0], every):
            p = 1984+i
            for h in range(Q.shape[1]):
                q=Q[i,h]; ex=K[:p+1,h//3]@q; ap=sc(h//3,q)[:p+1]
                kk=K.shape[0]//kfrac
                w=np.exp((ex-ex.max())/8); w/=w.sum()
                sel=np.zeros(p+1,bool); sel[:4]=True; sel[p+1-64:]=True
                sel[np.argpartition(-ap,kk-1)[:kk]]=True
                mass.append(w[sel].sum())
    return np.mean(mass)
