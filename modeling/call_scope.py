"""What one generate() call changes on objects every call shares, seen by that call alone.

A target may serve several threads at once (a chat server, a Gradio app). For its own duration, a speculative call
needs other behaviour from shared objects: the target's `_is_stateful` guard and two of its generate() helpers,
transformers' module function that splits outputs per token, a family's delta-rule kernels, and forward hooks on the
target's modules. Each such object gets, once per process, a dispatcher that looks up the running call's replacement
in a `ContextVar`; a call sets its replacements in its own context, and a thread starts with an empty context, so a
call in another thread sees the stock object. A generate() nested in a call (a stock assistant drafting) runs in
that call's context and sees its replacements, as it saw the process-wide patches they replace.

Every copy of the runtime in a process (the library, one per remote-code folder) uses the one variable, kept on
`transformers.generation.utils`, and the dispatchers of whichever copy installed them first: entries are keyed by
strings and hold plain callables, so any copy reads any other's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from types import MappingProxyType, ModuleType

import transformers.generation.utils as generation_utils
from torch import nn
from torch.utils.hooks import RemovableHandle

_VARIABLE = "_hyperdflash_call_scope"
_DISPATCHER = "_hyperdflash_dispatches"  # attribute of a dispatcher: the key it looks up


def _scope_variable() -> ContextVar[Mapping]:
    variable = getattr(generation_utils, _VARIABLE, None)
    if variable is None:
        variable = ContextVar(_VARIABLE, default=MappingProxyType({}))
        setattr(generation_utils, _VARIABLE, variable)
    return variable


def current(key: object, default: object = None) -> object:
    """The entry `key` of the running call, or `default` outside any call that set it."""
    return _scope_variable().get().get(key, default)


@contextmanager
def scoped(entries: Mapping) -> Iterator[None]:
    """Add `entries` to the scope of whatever runs inside the block, in this context only."""
    variable = _scope_variable()
    token = variable.set(MappingProxyType({**variable.get(), **entries}))
    try:
        yield
    finally:
        variable.reset(token)


def unwrapped(function: Callable) -> Callable:
    """The stock function behind any dispatchers."""
    while hasattr(function, _DISPATCHER):
        function = function.__wrapped__
    return function


def _dispatcher(original: Callable, key: str, bind_self: bool) -> Callable:
    """Calls the scope's replacement for `key` as `replacement(original, *args)` (original bound to the instance
    for a method, looked up by the instance's id), else `original`."""

    @functools.wraps(original)
    def dispatch(*args, **kwargs):
        entries = _scope_variable().get()
        if bind_self:
            replacement = entries.get((key, id(args[0])))
            if replacement is not None:
                return replacement(functools.partial(original, args[0]), *args[1:], **kwargs)
        else:
            replacement = entries.get(key)
            if replacement is not None:
                return replacement(original, *args, **kwargs)
        return original(*args, **kwargs)

    setattr(dispatch, _DISPATCHER, key)
    return dispatch


def _install_dispatcher(owner: type | ModuleType, name: str, key: str, bind_self: bool) -> None:
    current_value = vars(owner)[name]
    if getattr(current_value, _DISPATCHER, None) != key:
        setattr(owner, name, _dispatcher(current_value, key, bind_self))


def functions(module: ModuleType, **replacements: Callable) -> AbstractContextManager[None]:
    """Replace module functions (`module.<name>`, as the module's own code calls them) for this call; each
    replacement is called as `replacement(original, *args, **kwargs)`."""
    entries = {}
    for name, replacement in replacements.items():
        key = f"{module.__name__}.{name}"
        _install_dispatcher(module, name, key, bind_self=False)
        entries[key] = replacement
    return scoped(entries)


def _defining_class(instance: object, name: str) -> type:
    return next(klass for klass in type(instance).__mro__ if name in vars(klass))


def methods(instance: object, **replacements: Callable) -> AbstractContextManager[None]:
    """Replace methods of `instance` (not of other instances of its class) for this call; each replacement is
    called as `replacement(original_bound_method, *args, **kwargs)`."""
    entries = {}
    for name, replacement in replacements.items():
        owner = _defining_class(instance, name)
        key = f"{owner.__module__}.{owner.__qualname__}.{name}"
        _install_dispatcher(owner, name, key, bind_self=True)
        entries[(key, id(instance))] = replacement
    return scoped(entries)


class _ScopedFlag:
    """A class attribute that reads `lifted` for the instances a running call lifted it on."""

    def __init__(self, value: object, key: str, lifted: object):
        self.value, self.key, self.lifted = value, key, lifted
        setattr(self, _DISPATCHER, key)

    def __get__(self, instance: object, owner: type) -> object:
        if instance is not None and current((self.key, id(instance))) is not None:
            return self.lifted
        return self.value


def lifted_stateful_guard(model: nn.Module) -> AbstractContextManager[None]:
    """`model._is_stateful` reads False for this call (transformers refuses assisted decoding on stateful models;
    the call brings a cache that rolls back exactly). Other calls, and other instances, still see the stock value."""
    owner = _defining_class(model, "_is_stateful")
    key = f"{owner.__module__}.{owner.__qualname__}._is_stateful"
    if getattr(vars(owner)["_is_stateful"], _DISPATCHER, None) != key:
        owner._is_stateful = _ScopedFlag(vars(owner)["_is_stateful"], key, lifted=False)
    return scoped({(key, id(model)): True})


class CallHooks:
    """Forward hooks that run only for forwards of the call (the context) that registered them; removed on exit."""

    def __init__(self):
        self._marker = object()
        self._handles: list[RemovableHandle] = []
        self._scope = scoped({self._marker: True})

    def _only_in_this_call(self, hook: Callable) -> Callable:
        marker = self._marker

        def run_in_this_call(*args, **kwargs):
            if marker in _scope_variable().get():
                return hook(*args, **kwargs)
            return None

        return run_in_this_call

    def before(self, module: nn.Module, hook: Callable) -> None:
        self._handles.append(module.register_forward_pre_hook(self._only_in_this_call(hook)))

    def after(self, module: nn.Module, hook: Callable, with_kwargs: bool = False) -> None:
        hook = self._only_in_this_call(hook)
        self._handles.append(module.register_forward_hook(hook, with_kwargs=with_kwargs))

    def __enter__(self) -> CallHooks:
        self._scope.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._scope.__exit__(*exc)
