"""pagedkv.transformers: Hugging Face transformers (5.x) decoders generate on
pagedkv's pages and attention kernel.

    import pagedkv.transformers as pkt
    pkt.enable()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="pagedkv")
    cache = pkt.PagedKVCache(model.config, n_pages=4096, page_size=16)
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=64)

Two hooks of transformers carry it: ``PagedKVCache`` (a ``Cache``) keeps K and
V in ``pagedkv.PagedCache`` pages only (one pool for the full-attention
layers, one per sliding layer whose ``SequenceTable`` keeps only the
window), and the attention function registered as "pagedkv" runs
``pagedkv.paged_attention`` on them. A call the kernel cannot take (a padded
batch's mask, ``output_attentions``, an option this build's kernel lacks)
runs the model family's own eager attention on K/V gathered from the pages,
and counts in ``stats()["fallback_calls"]``. See docs/transformers.md.
"""
import sys
import threading
import weakref

import torch

import pagedkv

try:
    from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs
    from transformers.masking_utils import (AttentionMaskInterface, causal_mask_function, eager_mask,
                                            prepare_padding_mask)
    from transformers.modeling_utils import AttentionInterface
except ImportError as error:  # pragma: no cover - what users without transformers see
    raise ImportError("pagedkv.transformers needs Hugging Face transformers 5.x (pip install 'transformers>=5'); "
                      "importing it failed: %s" % error) from error

try:  # where transformers 5 records what output_attentions asked for
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # pragma: no cover
    _active_collector = None

__all__ = ["enable", "PagedKVCache", "stats", "reset_stats", "missing_kernel_options", "FAMILIES"]

NAME = "pagedkv"

# The families whose attention this module has been checked against
# transformers' own (python/tests/test_transformers.py): their layers are
# full or sliding-window attention with the options paged_attention takes.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "gpt_oss")

_LAYER_TYPES = ("full_attention", "sliding_attention")

# ---------------------------------------------------------------- stats

_stats_lock = threading.Lock()
_stats = {"kernel_calls": 0, "fallback_calls": 0}


def stats():
    """{"kernel_calls": n, "fallback_calls": n}: attention calls (one per layer and forward) that ran
    pagedkv's kernel, and those that ran transformers' eager attention instead, since reset_stats()."""
    with _stats_lock:
        return dict(_stats)


def reset_stats():
    with _stats_lock:
        for key in _stats:
            _stats[key] = 0


def _count(key):
    with _stats_lock:
        _stats[key] += 1


# ---------------------------------------------------------------- kernel options

_kernel_options = None


def _kernel_supports():
    """The options beyond the scale that this build's paged_attention takes (a set of names).

    Probed, not assumed: a package built before the kernel learned an option
    must fall back on the layers that need it, never drop the option."""
    global _kernel_options
    if _kernel_options is None:
        found = set()
        doc = pagedkv.paged_attention.__doc__ or ""
        signature = doc.split("\n", 1)[0]
        for name in ("window", "softcap", "sinks"):
            if name in signature:
                found.add(name)
        _kernel_options = found
    return _kernel_options


def missing_kernel_options(config):
    """The options a model of `config` needs that this build's kernel lacks ({"window", "softcap", "sinks"}):
    the layers that need one run the fallback (counted in fallback_calls)."""
    text = _text_config(config)
    needed = set()
    layer_types, _ = get_layer_types_and_kwargs(text)
    if "sliding_attention" in layer_types or getattr(text, "sliding_window", None):
        needed.add("window")
    if getattr(text, "attn_logit_softcapping", None):
        needed.add("softcap")
    if getattr(text, "model_type", None) == "gpt_oss":
        needed.add("sinks")
    return needed - _kernel_supports()


# ---------------------------------------------------------------- the cache


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


class _Step:
    """The forward in flight: its token count and the layers whose update it reached.

    Tokens commit only when the next forward starts (or at crop, reorder,
    reset): assisted decoding's crop then commits fewer tokens instead of
    rolling back a windowed table past what it kept."""

    __slots__ = ("n_tokens", "written", "serial")

    def __init__(self, n_tokens, serial):
        self.n_tokens = n_tokens
        self.written = set()
        self.serial = serial


class _Pool:
    """One PagedCache and its SequenceTable: every full-attention layer's, or one sliding layer's.

    A sliding layer has a pool of its own, so that it can write and attend a
    long forward in chunks, its table freeing what falls out of the window
    between chunks: its pages stay bounded by the window, the prompt's length
    notwithstanding."""

    def __init__(self, window, layers):
        self.window = window  # 0: full attention
        self.layers = layers  # the model's layer indices, in order: local index = position
        self.cache = None
        self.seqs = None
        self.rows = []
        self.length = 0  # committed tokens per row
        self.pending = 0  # written past `length`, committed by _settle
        self.page_table = None  # of the chunk in flight
        self.view = None

    def reserve(self, n_tokens):
        """prepare_append(n_tokens) on every row, all or nothing; False when the pool is short."""
        done = []
        for row in self.rows:
            if not self.seqs.prepare_append(row, n_tokens):
                for r in done:
                    self.seqs.truncate(r, self.length)
                return False
            done.append(row)
        self.page_table, lengths = self.seqs.batch(self.rows)
        self.view = self.cache.bind(self.page_table, lengths=lengths + self.pending + n_tokens)
        return True

    def commit(self, n_tokens):
        for row in self.rows:
            if n_tokens > 0:
                self.seqs.commit_append(row, n_tokens)
            else:
                self.seqs.truncate(row, self.length)  # the reserved pages go back
        self.length += n_tokens
        self.page_table = self.view = None


class _PagedLayer(CacheLayerMixin):
    """A layer of PagedKVCache: its K/V live in its pool's pages (no keys/values tensors)."""

    is_compileable = False
    is_croppable = True

    def __init__(self, owner, index, pool, local, window):
        super().__init__()
        self._owner = weakref.ref(owner)
        self.index = index
        self.pool = pool
        self.local = local
        self.sliding_window = window
        self.is_sliding = window > 0
        self.is_initialized = True  # storage is the cache's, made at its first update

    def __repr__(self):
        return "PagedLayer(%d%s)" % (self.index, ", window=%d" % self.sliding_window if self.is_sliding else "")

    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self._owner().update(key_states, value_states, self.index)

    def get_seq_length(self):
        return self._owner()._layer_length(self.index)

    def get_max_length(self):
        return self.sliding_window if self.is_sliding else -1

    def get_mask_sizes(self, query_length):
        # As DynamicLayer / DynamicSlidingWindowLayer: the mask covers
        # positions [kv_offset, length + query_length).
        length = self.get_seq_length()
        if not self.is_sliding:
            return length + query_length, 0
        w = self.sliding_window
        offset = max(length - w + 1, 0)
        return (w - 1 + query_length if length >= w else length + query_length), offset

    # The cache acts on every layer at once.
    def reset(self):
        pass

    def reorder_cache(self, beam_idx):
        pass

    def crop(self, tokens_to_remove):
        pass

    def batch_repeat_interleave(self, repeats):
        pass

    def batch_select_indices(self, indices):
        pass

    def offload(self):
        pass

    def prefetch(self):
        pass


# A sliding layer attends a forward in chunks of this many queries (the
# default of PagedKVCache's sliding_chunk), so its pool holds window - 1 +
# chunk tokens per row at most; a forward of at most this many tokens
# (decode, draft verification) is one chunk, which crop can take back whole.
SLIDING_CHUNK = 64


class PagedKVCache(Cache):
    """A transformers ``Cache`` whose K/V live in pagedkv pages.

    ``config``: the model's config (its decoder's is used). ``n_pages``
    pages of ``page_size`` tokens for the full-attention layers; each
    sliding layer gets a pool of its own sized to its window (see
    docs/transformers.md). ``layout`` "NHD" or "HND"; ``kv_format``
    "native", "fp8" or "int8"; ``device`` / ``dtype`` None: the model's
    (taken at the first forward); ``sliding_chunk`` None: ``SLIDING_CHUNK``
    (the queries a sliding layer attends at a time: its pool holds
    ``window - 1 + sliding_chunk`` tokens per row, and crop takes back at
    most the last chunk). The model must run with
    ``attn_implementation="pagedkv"`` (after ``enable()``). One cache serves
    one model and one batch (its rows are the batch's sequences) until
    ``reset()``.
    """

    def __init__(self, config, n_pages=4096, page_size=16, layout="NHD", kv_format="native", device=None,
                 dtype=None, sliding_chunk=None):
        text = _text_config(config)
        family = getattr(text, "model_type", None)
        if family not in FAMILIES:
            raise ValueError("pagedkv.transformers.PagedKVCache: argument 'config' expected a config of a supported "
                             "family (%s), got model_type %r" % (", ".join(FAMILIES), family))
        if sliding_chunk is None:
            sliding_chunk = SLIDING_CHUNK
        for name, value in (("n_pages", n_pages), ("page_size", page_size), ("sliding_chunk", sliding_chunk)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError("pagedkv.transformers.PagedKVCache: argument '%s' expected an int >= 1, got %r"
                                 % (name, value))
        if layout not in ("NHD", "HND"):
            raise ValueError("pagedkv.transformers.PagedKVCache: argument 'layout' expected \"NHD\" or \"HND\", got %r"
                             % (layout,))
        if kv_format not in ("native", "fp8", "int8"):
            raise ValueError("pagedkv.transformers.PagedKVCache: argument 'kv_format' expected \"native\", \"fp8\" or "
                             "\"int8\", got %r" % (kv_format,))
        if dtype is not None and dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError("pagedkv.transformers.PagedKVCache: argument 'dtype' expected None, torch.float32, "
                             "torch.float16 or torch.bfloat16, got %r" % (dtype,))
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
        for i, kind in enumerate(layer_types):
            if kind not in _LAYER_TYPES:
                raise ValueError("pagedkv.transformers.PagedKVCache: layer %d of this %s config is %r attention; "
                                 "supported: %s" % (i, family, kind, ", ".join(_LAYER_TYPES)))
        self.config = config
        self.family = family
        self.n_pages = n_pages
        self.page_size = page_size
        self.sliding_chunk = sliding_chunk
        self.layout = layout
        self.kv_format = kv_format
        self.device = None if device is None else torch.device(device)
        self.dtype = dtype
        self.n_heads = text.num_attention_heads
        self.n_kv_heads = getattr(text, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        full = _Pool(0, [])
        self.pools = [full]
        layers = []
        for i, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
            window = int(kwargs.get("sliding_window") or 0) if kind == "sliding_attention" else 0
            if window:
                pool = _Pool(window, [i])
                self.pools.append(pool)
            else:
                pool = full
                full.layers.append(i)
            layers.append(_PagedLayer(self, i, pool, len(pool.layers) - 1, window))
        if not full.layers:
            self.pools.remove(full)
        self._length = 0  # committed tokens per row (every row has as many: a padded batch pads)
        self._step = None
        self._serial = 0
        self._broken = None  # why the cache can no longer be used (a forward stopped half way), or None
        self._modules = {}  # layer index -> weakref to the attention module that ran it
        self._lock = threading.RLock()
        super().__init__(layers=layers)

    def __repr__(self):
        full = sum(len(p.layers) for p in self.pools if not p.window)
        windows = sorted({p.window for p in self.pools if p.window})
        return ("pagedkv.transformers.PagedKVCache(%s, n_pages=%d, page_size=%d, layout=%r, kv_format=%r, "
                "sliding_chunk=%d; %d full layers%s; %d rows of %d tokens)" % (
                    self.family, self.n_pages, self.page_size, self.layout, self.kv_format, self.sliding_chunk, full,
                    "".join(", %d of window %d" % (sum(1 for p in self.pools if p.window == w), w) for w in windows),
                    len(self.pools[0].rows), self._length))

    # ---------------------------------------------------------------- storage


    def _materialize(self, key_states, batch):
        """The pools' storage, made at the first update: the model's device and dtype unless given."""
        device = self.device if self.device is not None else key_states.device
        dtype = self.dtype if self.dtype is not None else key_states.dtype
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise RuntimeError("pagedkv.transformers.PagedKVCache: the model computes in %s; pagedkv's pages hold "
                               "float32, float16 or bfloat16 (pass dtype=)" % (dtype,))
        has_full = any(not pool.window for pool in self.pools)
        for pool in self.pools:
            if pool.cache is not None:
                continue
            if pool.window:
                # What a chunk's queries see, [start - window + 1, start + chunk), plus one page per row that
                # copy-on-write takes when beams share the last page: never short. A sliding table's rows hold
                # a subset of the columns the full-attention table's rows hold (the same forks, copies and
                # positions), so it never needs more pages than that pool has: n_pages sized to a short
                # request sizes the sliding pools too.
                span = pool.window - 1 + self.sliding_chunk
                n_pages = batch * (-(-span // self.page_size) + 2)
                if has_full:
                    n_pages = min(n_pages, self.n_pages)
            else:
                n_pages = self.n_pages
            pool.cache = pagedkv.PagedCache(len(pool.layers), n_pages, self.page_size, self.n_kv_heads,
                                            self.head_dim, device, dtype, self.layout, self.kv_format)
            pool.seqs = pagedkv.SequenceTable(pool.cache, window=pool.window)
        self.device, self.dtype = device, dtype

    @property
    def pages_in_use(self):
        """Pages held now, over every pool."""
        return sum(p.cache.n_pages - p.cache.n_free() for p in self.pools if p.cache is not None)

    @property
    def batch_size(self):
        return len(self.pools[0].rows) if self.pools[0].rows else -1

    # ---------------------------------------------------------------- steps

    def _layer_length(self, index):
        step = self._step
        return self._length + (step.n_tokens if step is not None and index in step.written else 0)

    def _begin(self, n_tokens):
        """A new forward of n_tokens: the full-attention pool reserves them now, all rows or none."""
        full = self.pools[0]
        if not full.window and not full.reserve(n_tokens):
            need = sum(-(-(self._length + n_tokens) // self.page_size) -
                       len([p for p in full.seqs.pages(r) if p >= 0]) for r in full.rows)
            raise RuntimeError(
                "pagedkv.transformers.PagedKVCache: the cache is too small: %d rows of %d + %d tokens need about %d "
                "more pages of %d tokens, and %d of n_pages=%d are free (raise n_pages)"
                % (len(full.rows), self._length, n_tokens, need, self.page_size, full.cache.n_free(),
                   full.cache.n_pages))
        if not full.window:
            full.pending = n_tokens
        self._serial += 1
        self._step = _Step(n_tokens, self._serial)

    def _settle(self, keep=None):
        """Ends the forward in flight: commits its tokens (the first `keep` of them) when every layer ran,
        drops them when the forward stopped half way."""
        step = self._step
        if step is None:
            return
        self._step = None
        complete = len(step.written) == len(self.layers)
        n = (step.n_tokens if keep is None else keep) if complete else 0
        for pool in self.pools:
            # A sliding pool committed the chunks before its last one as it went.
            done = pool.length - self._length
            if not complete and done > 0:
                self._broken = ("a forward stopped after sliding layer %d had committed %d of its tokens"
                                % (pool.layers[0], done))
                continue
            pool.commit(n - done)
            pool.pending = 0
        self._length += n

    def _abort(self):
        step = self._step
        if step is not None:
            step.written.clear()
            self._settle()

    def _check_usable(self):
        if self._broken is not None:
            raise RuntimeError("pagedkv.transformers.PagedKVCache: %s; its rows are no longer consistent: call "
                               "reset()" % self._broken)

    # ---------------------------------------------------------------- Cache

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        with self._lock:
            return self._update(key_states, value_states, layer_idx)

    def _update(self, key_states, value_states, layer_idx):
        self._check_usable()
        impl = getattr(_text_config(self.config), "_attn_implementation", None)
        if impl != NAME:
            raise RuntimeError("pagedkv.transformers.PagedKVCache: the model runs attn_implementation=%r; a "
                               "PagedKVCache needs \"pagedkv\" (pagedkv.transformers.enable(), then load the model "
                               "with attn_implementation=\"pagedkv\" and pass its model.config)" % (impl,))
        if not 0 <= layer_idx < len(self.layers):
            raise RuntimeError("pagedkv.transformers.PagedKVCache: layer %d of a model with %d layers: the cache was "
                               "made for another model" % (layer_idx, len(self.layers)))
        if key_states.dim() != 4 or key_states.shape != value_states.shape:
            raise RuntimeError("pagedkv.transformers.PagedKVCache: update expected key and value [B, H, S, D] of one "
                               "shape, got %s and %s" % (tuple(key_states.shape), tuple(value_states.shape)))
        batch, heads, n_tokens, dim = key_states.shape
        if heads != self.n_kv_heads or dim != self.head_dim:
            raise RuntimeError("pagedkv.transformers.PagedKVCache: layer %d gives %d kv heads of dim %d; the cache "
                               "was made for %d of dim %d (another model?)" % (layer_idx, heads, dim,
                                                                           self.n_kv_heads, self.head_dim))
        if key_states.requires_grad or value_states.requires_grad:
            raise RuntimeError("pagedkv.transformers.PagedKVCache: K/V that require grad; the pages hold inference "
                               "state only (run under torch.no_grad() or torch.inference_mode())")
        rows = self.pools[0].rows
        if rows and batch != len(rows):
            raise RuntimeError("pagedkv.transformers.PagedKVCache: a batch of %d sequences; the cache holds %d "
                               "(call reset() before reusing it for another batch)" % (batch, len(rows)))
        step = self._step
        if step is not None and (len(step.written) == len(self.layers) or layer_idx in step.written):
            self._settle()  # the previous forward finished (or stopped half way): a new one starts
            self._check_usable()
            step = None
        if step is not None and n_tokens != step.n_tokens:
            raise RuntimeError("pagedkv.transformers.PagedKVCache: layer %d gives %d new tokens, the layers before "
                               "it %d" % (layer_idx, n_tokens, step.n_tokens))
        if step is None:
            fresh = not rows
            if fresh:
                self._materialize(key_states, batch)
                for pool in self.pools:
                    pool.rows = [pool.seqs.create() for _ in range(batch)]
            try:
                self._begin(n_tokens)
            except BaseException:
                if fresh:  # a refused first forward leaves no rows behind: the next may bring another batch
                    self.reset()
                raise
            step = self._step
        layer = self.layers[layer_idx]
        if not layer.is_sliding:
            pool = layer.pool
            k = key_states.transpose(1, 2).to(device=self.device, dtype=self.dtype)
            v = value_states.transpose(1, 2).to(device=self.device, dtype=self.dtype)
            pool.cache.write(layer.local, pool.page_table, self._length, k, v)
        # A sliding layer's K/V go to its pages in the attention call, chunk by chunk.
        step.written.add(layer_idx)
        # The handle rides on the returned tensors: the attention function
        # finds this cache, layer and forward on the key it receives, so
        # models that run at once (nested generate, threads) never mix.
        key_out, value_out = key_states.detach(), value_states.detach()
        key_out._pagedkv = (weakref.ref(self), layer_idx, step.serial)
        return key_out, value_out

    def reset(self):
        with self._lock:
            self._step = None
            for pool in self.pools:
                for row in pool.rows:
                    pool.seqs.release(row)
                pool.rows = []
                pool.length = pool.pending = 0
                pool.page_table = pool.view = None
                if pool.window:  # sized for the batch: made again for the next one
                    pool.cache = pool.seqs = None
            self._length = 0
            self._broken = None
            self._modules = {}

    def crop(self, tokens_to_remove):
        """Drops the last -tokens_to_remove tokens (assisted decoding's rejected drafts)."""
        with self._lock:
            self._check_usable()
            if tokens_to_remove > 0:
                raise ValueError("pagedkv.transformers.PagedKVCache.crop: a positive value (%d) is not supported; pass "
                                 "minus the number of tokens to remove" % tokens_to_remove)
            drop = -tokens_to_remove
            step = self._step
            complete = step is not None and len(step.written) == len(self.layers)
            pending = step.n_tokens if complete else 0
            total = self._length + pending
            if drop > total:
                raise ValueError("pagedkv.transformers.PagedKVCache.crop: %d tokens to remove; the cache holds %d"
                                 % (drop, total))
            # What each sliding layer has not committed yet (its last chunk) is all it can give back.
            givable = min([pending] + [self._length + pending - p.length for p in self.pools if p.window])
            if drop <= givable:
                self._settle(keep=pending - drop)
                return
            if any(p.window for p in self.pools):
                raise ValueError("pagedkv.transformers.PagedKVCache.crop: %d tokens to remove, more than the sliding "
                                 "layers still hold uncommitted (%d): their tables freed what lies before their "
                                 "window" % (drop, givable))
            self._settle()
            keep = self._length - drop
            for pool in self.pools:
                for row in pool.rows:
                    pool.seqs.truncate(row, keep)
                pool.length = keep
            self._length = keep

    def _remap(self, sources):
        """Rows become forks of the old rows `sources` (beam search, batch selection); pages are shared
        until a row writes into a shared one (copy-on-write)."""
        self._check_usable()
        n = len(self.pools[0].rows)
        bad = [i for i in sources if not 0 <= i < n]
        if bad:
            raise IndexError("pagedkv.transformers.PagedKVCache: row %d of a batch of %d" % (bad[0], n))
        self._settle()
        self._check_usable()
        for pool in self.pools:
            old = pool.rows
            pool.rows = [pool.seqs.fork(old[i]) for i in sources]
            for row in old:
                pool.seqs.release(row)

    def reorder_cache(self, beam_idx):
        with self._lock:
            self._remap([int(i) for i in beam_idx.tolist()])

    def batch_select_indices(self, indices):
        with self._lock:
            if isinstance(indices, torch.Tensor):
                indices = indices.tolist() if indices.dtype != torch.bool else indices.nonzero().flatten().tolist()
            self._remap([int(i) for i in indices])

    def batch_repeat_interleave(self, repeats):
        with self._lock:
            n = len(self.pools[0].rows)
            self._remap([i for i in range(n) for _ in range(repeats)])

    def activate_past_recording(self, **kwargs):
        pass  # the forward in flight is committed lazily: crop needs no recording

    def offload(self, layer_idx, only_non_sliding=True):
        pass

    def prefetch(self, layer_idx, only_non_sliding=True):
        pass

    # ---------------------------------------------------------------- attention

    def _handle_for(self, module, layer_idx, serial):
        step = self._step
        if step is None or step.serial != serial or layer_idx not in step.written:
            raise RuntimeError("pagedkv.transformers: attention ran on K/V from an update that is no longer the "
                               "cache's forward in flight (layer %d)" % layer_idx)
        known = self._modules.get(layer_idx)
        if known is None or known() is None:
            self._modules[layer_idx] = weakref.ref(module)
        elif known() is not module:
            raise RuntimeError("pagedkv.transformers.PagedKVCache: layer %d runs another model's attention module "
                               "than the one the cache holds K/V for (call reset() to reuse a cache for another "
                               "model)" % layer_idx)
        return self.layers[layer_idx]

    def _gather(self, layer, first, end):
        """K/V [B, H, T, D] of positions [first, end) of the layer's pool (its chunk in flight mapped)."""
        pool = layer.pool
        col = first // self.page_size
        table = pool.page_table[:, col:]
        lengths = torch.full((len(pool.rows),), end - col * self.page_size, dtype=torch.long)
        k, v = pool.cache.gather(layer.local, table, lengths)
        skip = first - col * self.page_size
        return k[:, skip:].transpose(1, 2), v[:, skip:].transpose(1, 2)


# ---------------------------------------------------------------- attention and mask functions


def _eager_of(module):
    """The eager attention of the module's family (it knows the family's soft-cap, sinks, ...)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as fn
    return fn


def _causal_mask(n_queries, first_query, n_keys, first_key, window, dtype, device):
    """[1, 1, Sq, T] additive mask: causal, within `window` when > 0."""
    q = torch.arange(first_query, first_query + n_queries, device=device).view(-1, 1)
    k = torch.arange(first_key, first_key + n_keys, device=device).view(1, -1)
    allowed = k <= q
    if window:
        allowed &= k > q - window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min).view(1, 1, n_queries, n_keys)


def _as_additive(mask, dtype):
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    return mask


def _wants_attentions():
    if _active_collector is None:
        return False
    try:
        collected = _active_collector.get()
    except LookupError:
        return False
    return bool(collected) and "attentions" in collected


def _eager(module, query, key, value, mask, first_query, first_key, window, dropout, scaling, softcap, s_aux,
           kwargs):
    if mask is None:
        mask = _causal_mask(query.shape[2], first_query, key.shape[2], first_key, window, query.dtype, query.device)
    else:
        mask = _as_additive(mask, query.dtype)
    extra = dict(kwargs)
    if softcap is not None:
        extra["softcap"] = softcap
    if s_aux is not None:
        extra["s_aux"] = s_aux
    return _eager_of(module)(module, query, key.to(query.dtype), value.to(query.dtype), mask, dropout=dropout,
                             scaling=scaling, sliding_window=window or None, **extra)


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
              softcap=None, s_aux=None, **kwargs):
    """The "pagedkv" attention: query [B, Hq, Sq, D]; key/value as PagedKVCache.update returned them.
    Returns (output [B, Sq, Hq, D], None or the fallback's weights)."""
    window = int(sliding_window or 0)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    handle = getattr(key, "_pagedkv", None)
    if handle is None:
        # Not a PagedKVCache's K/V (another cache, or none): transformers' attention on them as given.
        _count("fallback_calls")
        first_query = key.shape[2] - query.shape[2]
        return _eager(module, query, key, value, attention_mask, first_query, 0, window, dropout, scaling,
                      softcap, s_aux, kwargs)
    cache_ref, layer_idx, serial = handle
    cache = cache_ref()
    if cache is None:
        raise RuntimeError("pagedkv.transformers: K/V of a PagedKVCache that no longer exists")
    with cache._lock:
        try:
            return _paged(cache, module, query, key, value, attention_mask, layer_idx, serial, dropout, scaling,
                          window, softcap, s_aux, kwargs)
        except BaseException:
            cache._abort()  # nothing of this forward stays in the cache
            raise


def _fallback_reason(module, attention_mask, dropout, window, softcap, s_aux):
    if attention_mask is not None:
        return "mask"
    if _wants_attentions():
        return "output_attentions"
    if dropout and module.training:
        return "dropout"
    options = _kernel_supports()
    if window and "window" not in options:
        return "window"
    if softcap and "softcap" not in options:
        return "softcap"
    if s_aux is not None and "sinks" not in options:
        return "sinks"
    return None


def _kernel(cache, layer, query, scaling, window, softcap, s_aux):
    q = query.transpose(1, 2).to(cache.dtype)
    options = {}
    if window:
        options["window"] = window
    if softcap:
        options["softcap"] = float(softcap)
    if s_aux is not None:
        options["sinks"] = s_aux.detach().to(device=cache.device, dtype=torch.float32)
    out = pagedkv.paged_attention(layer.pool.view, layer.local, q, float(scaling), **options)
    return out.to(query.dtype)


def _paged(cache, module, query, key, value, attention_mask, layer_idx, serial, dropout, scaling, window, softcap,
           s_aux, kwargs):
    layer = cache._handle_for(module, layer_idx, serial)
    if layer.is_sliding and window != layer.sliding_window:
        raise RuntimeError("pagedkv.transformers: layer %d attends with sliding_window=%r, but the cache keeps a "
                           "window of %d tokens for it (a config that does not match the model?)"
                           % (layer_idx, window or None, layer.sliding_window))
    reason = _fallback_reason(module, attention_mask, dropout, window, softcap, s_aux)
    _count("kernel_calls" if reason is None else "fallback_calls")
    n_queries = query.shape[2]
    base = cache._length  # positions [base, base + n_queries) are this forward's
    end = base + n_queries
    # A mask's columns are the last positions up to `end` (transformers' kv_offset, or all of them).
    mask_first = end - attention_mask.shape[-1] if attention_mask is not None else 0
    if not layer.is_sliding:
        if reason is None:
            return _kernel(cache, layer, query, scaling, window, softcap, s_aux), None
        first = max(base - window + 1, 0) if window else 0
        key, value = cache._gather(layer, first, end)
        mask = attention_mask[..., first - mask_first:] if attention_mask is not None else None
        return _eager(module, query, key, value, mask, base, first, window, dropout, scaling, softcap, s_aux, kwargs)
    pool = layer.pool
    chunk = cache.sliding_chunk
    outputs, weights = [], None
    for start in range(0, n_queries, chunk):
        stop = min(start + chunk, n_queries)
        if pool.pending:  # the chunk before: its tokens are in, its queries done
            pool.commit(pool.pending)
            pool.pending = 0
        if not pool.reserve(stop - start):
            raise RuntimeError("pagedkv.transformers.PagedKVCache: sliding layer %d's pool is short of pages "
                               "(%d free of %d)" % (layer_idx, pool.cache.n_free(), pool.cache.n_pages))
        k = key[:, :, start:stop].transpose(1, 2).to(device=cache.device, dtype=cache.dtype)
        v = value[:, :, start:stop].transpose(1, 2).to(device=cache.device, dtype=cache.dtype)
        pool.cache.write(0, pool.page_table, pool.length, k, v)
        pool.pending = stop - start
        q = query[:, :, start:stop]
        if reason is None:
            outputs.append(_kernel(cache, layer, q, scaling, window, softcap, s_aux))
            continue
        q_first = base + start
        first = max(q_first - window + 1, 0)
        kk, vv = cache._gather(layer, first, base + stop)
        mask = None
        if attention_mask is not None:
            mask = attention_mask[:, :, start:stop, first - mask_first:base + stop - mask_first]
        out, weights = _eager(module, q, kk, vv, mask, q_first, first, window, dropout, scaling, softcap, s_aux,
                              kwargs)
        outputs.append(out)
    if len(outputs) > 1:
        weights = None  # a chunk's weights cover its own keys only
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), weights


def mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
         attention_mask=None, allow_is_causal_skip=True, use_vmap=False, dtype=torch.float32, **kwargs):
    """The "pagedkv" mask: None where the kernel's own causal (and window) masking is the mask (no padding
    in the keys' range, no custom pattern); otherwise transformers' eager mask, for the fallback."""
    plain = allow_is_causal_skip and not use_vmap
    if plain:
        padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
        if padding is None or bool(padding[:, kv_offset:kv_offset + kv_length].all()):
            return None
    return eager_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                      kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, dtype=dtype,
                      use_vmap=use_vmap, **kwargs)


_enable_lock = threading.Lock()


def enable():
    """Registers attn_implementation "pagedkv" (attention and mask) with transformers; idempotent."""
    with _enable_lock:
        AttentionInterface.register(NAME, attention)
        AttentionMaskInterface.register(NAME, mask)
