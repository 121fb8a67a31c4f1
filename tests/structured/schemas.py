"""20 pydantic models covering nested objects, arrays, enums, required and optional fields, bounded numbers
and patterned strings; strings and arrays are bounded so a small max_tokens always fits a whole object."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, Field

Name = Field(min_length=1, max_length=12)


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Person(BaseModel):
    name: str = Name
    age: int = Field(ge=0, le=120)


class Point(BaseModel):
    x: float = Field(ge=-10, le=10)
    y: float = Field(ge=-10, le=10)


class Line(BaseModel):
    start: Point
    end: Point


class Paint(BaseModel):
    color: Color
    litres: int = Field(ge=1, le=20)


class Tags(BaseModel):
    tags: list[str] = Field(min_length=1, max_length=3)


class ZipCode(BaseModel):
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Phone(BaseModel):
    phone: str = Field(pattern=r"^\+[0-9]{2} [0-9]{3}-[0-9]{4}$")


class Flag(BaseModel):
    enabled: bool
    reason: str = Name


class Scores(BaseModel):
    scores: list[int] = Field(min_length=2, max_length=4)


class Address(BaseModel):
    street: str = Name
    city: str = Name
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Customer(BaseModel):
    person: Person
    address: Address


class Status(BaseModel):
    status: Literal["active", "suspended", "closed"]


class Temperature(BaseModel):
    celsius: float = Field(ge=-50, le=60)


class Optional_(BaseModel):
    title: str = Name
    subtitle: str | None = Field(default=None, max_length=12)


class Item(BaseModel):
    sku: str = Field(pattern=r"^[A-Z]{3}-[0-9]{3}$")
    quantity: int = Field(ge=1, le=9)


class Order(BaseModel):
    items: list[Item] = Field(min_length=1, max_length=2)


class Matrix(BaseModel):
    rows: list[list[int]] = Field(min_length=1, max_length=2)


class Rating(BaseModel):
    stars: int = Field(ge=1, le=5)
    comment: str = Name


class Version(BaseModel):
    version: str = Field(pattern=r"^[0-9]\.[0-9]\.[0-9]$")


class Event(BaseModel):
    name: str = Name
    kind: Color
    where: Point
    attendees: list[Person] = Field(max_length=2)


SCHEMAS: list[type[BaseModel]] = [
    Person, Point, Line, Paint, Tags, ZipCode, Phone, Flag, Scores, Address,
    Customer, Status, Temperature, Optional_, Item, Order, Matrix, Rating, Version, Event,
]
