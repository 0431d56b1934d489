"""A small inventory system: items, stock levels, and reorder suggestions."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Item:
    sku: str
    name: str
    unit_price: float
    quantity: int = 0
    reorder_level: int = 10

    def value(self) -> float:
        """The total value of this item's stock."""
        return self.unit_price * self.quantity

    def needs_reorder(self) -> bool:
        return self.quantity <= self.reorder_level


@dataclass
class Inventory:
    items: dict[str, Item] = field(default_factory=dict)

    def add(self, item: Item) -> None:
        if item.sku in self.items:
            raise ValueError(f"duplicate SKU: {item.sku}")
        self.items[item.sku] = item

    def receive(self, sku: str, amount: int) -> None:
        if amount <= 0:
            raise ValueError("amount must be positive")
        self.items[sku].quantity += amount

    def ship(self, sku: str, amount: int) -> None:
        item = self.items[sku]
        if amount > item.quantity:
            raise ValueError(f"only {item.quantity} of {sku} in stock")
        item.quantity -= amount

    def total_value(self) -> float:
        return sum(item.value() for item in self.items.values())

    def reorder_list(self) -> list[str]:
        """SKUs at or below their reorder level, lowest stock first."""
        low = [item for item in self.items.values() if item.needs_reorder()]
        low.sort(key=lambda item: item.quantity)
        return [item.sku for item in low]


def load_csv(path: str) -> Inventory:
    import csv

    inventory = Inventory()
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            inventory.add(
                Item(
                    sku=row["sku"],
                    name=row["name"],
                    unit_price=float(row["unit_price"]),
                    quantity=int(row["quantity"]),
                    reorder_level=int(row.get("reorder_level") or 10),
                )
            )
    return inventory


if __name__ == "__main__":
    inv = Inventory()
    inv.add(Item("A100", "bolts", 0.25, quantity=400))
    inv.add(Item("B200", "nuts", 0.10, quantity=8))
    inv.add(Item("C300", "washers", 0.05, quantity=12, reorder_level=20))
    inv.ship("A100", 150)
    print(f"total value: {inv.total_value():.2f}")
    print("reorder:", ", ".join(inv.reorder_list()))
