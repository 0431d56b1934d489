def binary_search(items, target):
    """Return the index of target in the sorted list items, or -1 if it is absent."""
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1


def merge_sort(items):
    """Sort a list by splitting it in half, sorting each half, and merging the results."""
    if len(items) <= 1:
        return list(items)
    mid = len(items) // 2
    left = merge_sort(items[:mid])
    right = merge_sort(items[mid:])
    merged = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            merged.append(left[i])
            i += 1
        else:
            merged.append(right[j])
            j += 1
    merged.extend(left[i:])
    merged.extend(right[j:])
    return merged


def fibonacci(n):
    """Return the first n Fibonacci numbers."""
    numbers = []
    a, b = 0, 1
    for _ in range(n):
        numbers.append(a)
        a, b = b, a + b
    return numbers


def is_prime(n):
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    divisor = 3
    while divisor * divisor <= n:
        if n % divisor == 0:
            return False
        divisor += 2
    return True


def word_counts(text):
    """Count how often each word appears, ignoring case and punctuation."""
    counts = {}
    for raw in text.split():
        word = raw.strip(".,;:!?\"'()").lower()
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts


class Stack:
    def __init__(self):
        self._items = []

    def push(self, item):
        self._items.append(item)

    def pop(self):
        if not self._items:
            raise IndexError("pop from an empty stack")
        return self._items.pop()

    def peek(self):
        return self._items[-1] if self._items else None

    def __len__(self):
        return len(self._items)


def balanced(expression):
    """True if every bracket in expression is closed in the right order."""
    pairs = {")": "(", "]": "[", "}": "{"}
    stack = Stack()
    for char in expression:
        if char in "([{":
            stack.push(char)
        elif char in pairs:
            if len(stack) == 0 or stack.pop() != pairs[char]:
                return False
    return len(stack) == 0


if __name__ == "__main__":
    print(binary_search([1, 3, 5, 7, 9, 11], 7))
    print(merge_sort([5, 2, 9, 1, 5, 6]))
    print(fibonacci(10))
    print([n for n in range(30) if is_prime(n)])
    print(balanced("{[()()]}"), balanced("([)]"))
