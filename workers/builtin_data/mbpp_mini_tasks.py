"""The tasks of `builtin:mbpp-mini`, written for mortal (MBPP-style, not taken from MBPP).

Read by make.py (a developer's script; not shipped). Each task: what to write, a reference solution
(used only by tests/workers/rewards/test_environments.py, which runs every one against its tests in the
sandbox), and assert statements. The first assert is shown in the prompt so the name and call
shape are unambiguous, as MBPP does.
"""

from __future__ import annotations

# (instruction, reference solution, tests)
TASKS: list[tuple[str, str, list[str]]] = [
    (
        "`count_vowels(s)` returns how many vowels (a, e, i, o, u, in either case) the string `s` has.",
        "def count_vowels(s):\n    return sum(1 for c in s.lower() if c in 'aeiou')\n",
        [
            "assert count_vowels('Mortal') == 2",
            "assert count_vowels('') == 0",
            "assert count_vowels('AEIOU xyz') == 5",
        ],
    ),
    (
        "`second_largest(nums)` returns the second largest distinct value in `nums`, or None if there is none.",
        "def second_largest(nums):\n    values = sorted(set(nums), reverse=True)\n"
        "    return values[1] if len(values) > 1 else None\n",
        [
            "assert second_largest([4, 9, 2, 9]) == 4",
            "assert second_largest([5, 5]) is None",
            "assert second_largest([-1, -7, -3]) == -3",
        ],
    ),
    (
        "`is_palindrome(s)` tells whether `s` reads the same backwards, ignoring case and anything that is not "
        "a letter or digit.",
        "def is_palindrome(s):\n    kept = [c.lower() for c in s if c.isalnum()]\n    return kept == kept[::-1]\n",
        [
            "assert is_palindrome('Never odd or even')",
            "assert not is_palindrome('palindrome')",
            "assert is_palindrome('12:21')",
        ],
    ),
    (
        "`running_total(nums)` returns the list of cumulative sums of `nums`.",
        "def running_total(nums):\n    out, total = [], 0\n    for n in nums:\n        total += n\n        out.append(total)\n"
        "    return out\n",
        [
            "assert running_total([3, 1, 4]) == [3, 4, 8]",
            "assert running_total([]) == []",
            "assert running_total([5, -5, 2]) == [5, 0, 2]",
        ],
    ),
    (
        "`add_dicts(a, b)` returns a new dict with every key of `a` and `b`; values of keys in both are added.",
        "def add_dicts(a, b):\n    out = dict(a)\n    for k, v in b.items():\n        out[k] = out.get(k, 0) + v\n"
        "    return out\n",
        [
            "assert add_dicts({'x': 1, 'y': 2}, {'y': 3, 'z': 4}) == {'x': 1, 'y': 5, 'z': 4}",
            "assert add_dicts({}, {'a': 1}) == {'a': 1}",
            "assert add_dicts({'a': 1}, {}) == {'a': 1}",
        ],
    ),
    (
        "`chunk(items, size)` splits the list `items` into consecutive lists of `size` elements (the last may be "
        "shorter).",
        "def chunk(items, size):\n    return [items[i:i + size] for i in range(0, len(items), size)]\n",
        [
            "assert chunk([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]",
            "assert chunk([], 3) == []",
            "assert chunk(['a', 'b'], 5) == [['a', 'b']]",
        ],
    ),
    (
        "`flatten(nested)` returns the values of an arbitrarily nested list in order, as one flat list.",
        "def flatten(nested):\n    out = []\n    for x in nested:\n        if isinstance(x, list):\n"
        "            out.extend(flatten(x))\n        else:\n            out.append(x)\n    return out\n",
        [
            "assert flatten([1, [2, [3, [4]]], 5]) == [1, 2, 3, 4, 5]",
            "assert flatten([]) == []",
            "assert flatten([[], ['a'], [['b']]]) == ['a', 'b']",
        ],
    ),
    (
        "`digit_sum(n)` returns the sum of the decimal digits of the integer `n` (ignore a minus sign).",
        "def digit_sum(n):\n    return sum(int(d) for d in str(abs(n)))\n",
        ["assert digit_sum(2024) == 8", "assert digit_sum(0) == 0", "assert digit_sum(-95) == 14"],
    ),
    (
        "`caesar(text, shift)` shifts every letter of `text` by `shift` places in the alphabet (wrapping around, "
        "keeping case) and leaves other characters alone.",
        "def caesar(text, shift):\n    out = []\n    for c in text:\n        if c.isalpha() and c.isascii():\n"
        "            base = ord('A') if c.isupper() else ord('a')\n            out.append(chr((ord(c) - base + shift) % 26 + base))\n"
        "        else:\n            out.append(c)\n    return ''.join(out)\n",
        [
            "assert caesar('abc', 1) == 'bcd'",
            "assert caesar('Zoo!', 2) == 'Bqq!'",
            "assert caesar('hello', -1) == 'gdkkn'",
        ],
    ),
    (
        "`word_lengths(sentence)` returns a dict mapping each space-separated word of `sentence` to its length.",
        "def word_lengths(sentence):\n    return {w: len(w) for w in sentence.split()}\n",
        [
            "assert word_lengths('to be or') == {'to': 2, 'be': 2, 'or': 2}",
            "assert word_lengths('') == {}",
            "assert word_lengths('rocket  ship') == {'rocket': 6, 'ship': 4}",
        ],
    ),
    (
        "`gcd_of(nums)` returns the greatest common divisor of a non-empty list of positive integers.",
        "import math\n\ndef gcd_of(nums):\n    g = 0\n    for n in nums:\n        g = math.gcd(g, n)\n    return g\n",
        ["assert gcd_of([12, 18, 30]) == 6", "assert gcd_of([7]) == 7", "assert gcd_of([9, 28]) == 1"],
    ),
    (
        "`is_prime(n)` tells whether the integer `n` is a prime number.",
        "def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n        if n % i == 0:\n"
        "            return False\n        i += 1\n    return True\n",
        ["assert is_prime(97)", "assert not is_prime(1)", "assert not is_prime(91)"],
    ),
    (
        "`primes_below(n)` returns the sorted list of primes smaller than `n`.",
        "def primes_below(n):\n    return [p for p in range(2, n) if all(p % d for d in range(2, int(p ** 0.5) + 1))]\n",
        [
            "assert primes_below(12) == [2, 3, 5, 7, 11]",
            "assert primes_below(2) == []",
            "assert len(primes_below(100)) == 25",
        ],
    ),
    (
        "`rotate_left(items, k)` returns `items` rotated left by `k` places (`k` may be larger than the length).",
        "def rotate_left(items, k):\n    if not items:\n        return []\n    k %= len(items)\n    return items[k:] + items[:k]\n",
        [
            "assert rotate_left([1, 2, 3, 4], 1) == [2, 3, 4, 1]",
            "assert rotate_left([1, 2, 3], 5) == [3, 1, 2]",
            "assert rotate_left([], 3) == []",
        ],
    ),
    (
        "`word_counts(text)` returns a dict of how often each lower-cased, space-separated word occurs in `text`.",
        "def word_counts(text):\n    out = {}\n    for w in text.lower().split():\n        out[w] = out.get(w, 0) + 1\n"
        "    return out\n",
        [
            "assert word_counts('The cat saw the dog') == {'the': 2, 'cat': 1, 'saw': 1, 'dog': 1}",
            "assert word_counts('') == {}",
            "assert word_counts('a A a') == {'a': 3}",
        ],
    ),
    (
        "`dedupe(items)` returns `items` without repeated values, keeping the first occurrence of each, in order.",
        "def dedupe(items):\n    seen, out = set(), []\n    for x in items:\n        if x not in seen:\n            seen.add(x)\n"
        "            out.append(x)\n    return out\n",
        [
            "assert dedupe([3, 1, 3, 2, 1]) == [3, 1, 2]",
            "assert dedupe([]) == []",
            "assert dedupe(['b', 'a', 'b']) == ['b', 'a']",
        ],
    ),
    (
        "`title_words(s)` returns `s` with the first letter of every space-separated word upper-cased and the rest "
        "lower-cased, words joined by single spaces.",
        "def title_words(s):\n    return ' '.join(w[:1].upper() + w[1:].lower() for w in s.split())\n",
        [
            "assert title_words('hello wORLD') == 'Hello World'",
            "assert title_words('') == ''",
            "assert title_words('  a  b ') == 'A B'",
        ],
    ),
    (
        "`max_subarray(nums)` returns the largest sum of a non-empty run of consecutive elements of `nums`.",
        "def max_subarray(nums):\n    best = current = nums[0]\n    for x in nums[1:]:\n        current = max(x, current + x)\n"
        "        best = max(best, current)\n    return best\n",
        [
            "assert max_subarray([2, -3, 4, -1, 2, -5, 3]) == 5",
            "assert max_subarray([-4, -2, -7]) == -2",
            "assert max_subarray([1, 2, 3]) == 6",
        ],
    ),
    (
        "`to_binary(n)` returns the binary digits of the non-negative integer `n` as a string, without a prefix.",
        "def to_binary(n):\n    return bin(n)[2:]\n",
        [
            "assert to_binary(10) == '1010'",
            "assert to_binary(0) == '0'",
            "assert to_binary(255) == '11111111'",
        ],
    ),
    (
        "`from_roman(s)` converts a Roman numeral (I, V, X, L, C, D, M, with subtractive pairs) to an integer.",
        "def from_roman(s):\n    values = {'I': 1, 'V': 5, 'X': 10, 'L': 50, 'C': 100, 'D': 500, 'M': 1000}\n    total = 0\n"
        "    for i, c in enumerate(s):\n        v = values[c]\n        if i + 1 < len(s) and values[s[i + 1]] > v:\n"
        "            total -= v\n        else:\n            total += v\n    return total\n",
        [
            "assert from_roman('XIV') == 14",
            "assert from_roman('MCMXC') == 1990",
            "assert from_roman('III') == 3",
        ],
    ),
    (
        "`to_roman(n)` converts an integer from 1 to 3999 to a Roman numeral.",
        "def to_roman(n):\n    pairs = [(1000, 'M'), (900, 'CM'), (500, 'D'), (400, 'CD'), (100, 'C'), (90, 'XC'), (50, 'L'),\n"
        "             (40, 'XL'), (10, 'X'), (9, 'IX'), (5, 'V'), (4, 'IV'), (1, 'I')]\n    out = ''\n"
        "    for value, letters in pairs:\n        while n >= value:\n            out += letters\n            n -= value\n"
        "    return out\n",
        [
            "assert to_roman(14) == 'XIV'",
            "assert to_roman(2024) == 'MMXXIV'",
            "assert to_roman(3999) == 'MMMCMXCIX'",
        ],
    ),
    (
        "`transpose(matrix)` returns the transpose of a rectangular matrix given as a list of rows.",
        "def transpose(matrix):\n    return [list(row) for row in zip(*matrix)]\n",
        [
            "assert transpose([[1, 2, 3], [4, 5, 6]]) == [[1, 4], [2, 5], [3, 6]]",
            "assert transpose([[7]]) == [[7]]",
            "assert transpose([]) == []",
        ],
    ),
    (
        "`count_pairs(nums, target)` returns how many index pairs i < j have nums[i] + nums[j] == target.",
        "def count_pairs(nums, target):\n    return sum(1 for i in range(len(nums)) for j in range(i + 1, len(nums))\n"
        "               if nums[i] + nums[j] == target)\n",
        [
            "assert count_pairs([1, 5, 3, 3, 2, 4], 6) == 3",
            "assert count_pairs([], 1) == 0",
            "assert count_pairs([2, 2, 2], 4) == 3",
        ],
    ),
    (
        "`longest_word(sentence)` returns the longest space-separated word of `sentence` (the first one on a tie).",
        "def longest_word(sentence):\n    best = ''\n    for w in sentence.split():\n        if len(w) > len(best):\n"
        "            best = w\n    return best\n",
        [
            "assert longest_word('a quick brown fox') == 'quick'",
            "assert longest_word('ab cd') == 'ab'",
            "assert longest_word('') == ''",
        ],
    ),
    (
        "`is_anagram(a, b)` tells whether the strings are anagrams of each other, ignoring spaces and case.",
        "def is_anagram(a, b):\n    clean = lambda s: sorted(s.replace(' ', '').lower())\n    return clean(a) == clean(b)\n",
        [
            "assert is_anagram('Dormitory', 'dirty room')",
            "assert not is_anagram('abc', 'abd')",
            "assert is_anagram('', '  ')",
        ],
    ),
    (
        "`fizz_buzz(n)` returns a list for 1..n: 'Fizz' for multiples of 3, 'Buzz' for multiples of 5, 'FizzBuzz' "
        "for both, else the number as a string.",
        "def fizz_buzz(n):\n    out = []\n    for i in range(1, n + 1):\n"
        "        out.append('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else str(i))\n"
        "    return out\n",
        [
            "assert fizz_buzz(5) == ['1', '2', 'Fizz', '4', 'Buzz']",
            "assert fizz_buzz(15)[-1] == 'FizzBuzz'",
            "assert fizz_buzz(0) == []",
        ],
    ),
    (
        "`median(nums)` returns the median of a non-empty list of numbers (the mean of the middle two for an even "
        "count).",
        "def median(nums):\n    s = sorted(nums)\n    mid = len(s) // 2\n    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2\n",
        ["assert median([3, 1, 2]) == 2", "assert median([4, 1, 3, 2]) == 2.5", "assert median([7]) == 7"],
    ),
    (
        "`run_length(s)` encodes `s` as each character followed by how many times it repeats in a row, e.g. "
        "'aab' -> 'a2b1'.",
        "def run_length(s):\n    out, i = [], 0\n    while i < len(s):\n        j = i\n        while j < len(s) and s[j] == s[i]:\n"
        "            j += 1\n        out.append(s[i] + str(j - i))\n        i = j\n    return ''.join(out)\n",
        [
            "assert run_length('aaabcc') == 'a3b1c2'",
            "assert run_length('') == ''",
            "assert run_length('zz') == 'z2'",
        ],
    ),
    (
        "`is_sorted(items)` tells whether `items` is in non-decreasing order.",
        "def is_sorted(items):\n    return all(a <= b for a, b in zip(items, items[1:]))\n",
        ["assert is_sorted([1, 2, 2, 5])", "assert not is_sorted([3, 1])", "assert is_sorted([])"],
    ),
    (
        "`index_of_min(items)` returns the index of the first smallest element of a non-empty list.",
        "def index_of_min(items):\n    return min(range(len(items)), key=lambda i: items[i])\n",
        [
            "assert index_of_min([4, 2, 8, 2]) == 1",
            "assert index_of_min([9]) == 0",
            "assert index_of_min([-1, -5, 0]) == 1",
        ],
    ),
    (
        "`factorial(n)` returns n! for a non-negative integer `n`.",
        "def factorial(n):\n    out = 1\n    for i in range(2, n + 1):\n        out *= i\n    return out\n",
        ["assert factorial(5) == 120", "assert factorial(0) == 1", "assert factorial(12) == 479001600"],
    ),
    (
        "`fib(n)` returns the n-th Fibonacci number, with fib(0) == 0 and fib(1) == 1.",
        "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
        ["assert fib(10) == 55", "assert fib(0) == 0", "assert fib(50) == 12586269025"],
    ),
    (
        "`most_common_char(s)` returns the character that occurs most often in the non-empty string `s` (the one "
        "that appears first on a tie).",
        "def most_common_char(s):\n    return max(s, key=lambda c: (s.count(c), -s.index(c)))\n",
        [
            "assert most_common_char('banana') == 'a'",
            "assert most_common_char('abab') == 'a'",
            "assert most_common_char('x') == 'x'",
        ],
    ),
    (
        "`alternate_case(s)` returns `s` with characters at even indexes upper-cased and at odd indexes lower-cased.",
        "def alternate_case(s):\n    return ''.join(c.upper() if i % 2 == 0 else c.lower() for i, c in enumerate(s))\n",
        [
            "assert alternate_case('python') == 'PyThOn'",
            "assert alternate_case('') == ''",
            "assert alternate_case('AB') == 'Ab'",
        ],
    ),
    (
        "`is_leap(year)` tells whether `year` is a leap year in the Gregorian calendar.",
        "def is_leap(year):\n    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n",
        ["assert is_leap(2024)", "assert not is_leap(1900)", "assert is_leap(2000)"],
    ),
    (
        "`sum_of_squares(n)` returns 1*1 + 2*2 + ... + n*n (0 for n == 0).",
        "def sum_of_squares(n):\n    return sum(i * i for i in range(1, n + 1))\n",
        [
            "assert sum_of_squares(3) == 14",
            "assert sum_of_squares(0) == 0",
            "assert sum_of_squares(10) == 385",
        ],
    ),
    (
        "`reverse_words(s)` returns the space-separated words of `s` in reverse order, joined by single spaces.",
        "def reverse_words(s):\n    return ' '.join(reversed(s.split()))\n",
        [
            "assert reverse_words('one two three') == 'three two one'",
            "assert reverse_words('solo') == 'solo'",
            "assert reverse_words('') == ''",
        ],
    ),
    (
        "`count_upper(s)` returns how many upper-case letters the string `s` contains.",
        "def count_upper(s):\n    return sum(1 for c in s if c.isupper())\n",
        [
            "assert count_upper('Hello World') == 2",
            "assert count_upper('abc') == 0",
            "assert count_upper('ABC def G') == 4",
        ],
    ),
    (
        "`interleave(a, b)` returns the elements of lists `a` and `b` alternately, starting with `a`, then the "
        "rest of the longer one.",
        "def interleave(a, b):\n    out = []\n    for i in range(max(len(a), len(b))):\n        if i < len(a):\n"
        "            out.append(a[i])\n        if i < len(b):\n            out.append(b[i])\n    return out\n",
        [
            "assert interleave([1, 2, 3], ['a', 'b']) == [1, 'a', 2, 'b', 3]",
            "assert interleave([], [4]) == [4]",
            "assert interleave([1], []) == [1]",
        ],
    ),
    (
        "`unique_sorted(items)` returns the distinct values of `items` in ascending order.",
        "def unique_sorted(items):\n    return sorted(set(items))\n",
        [
            "assert unique_sorted([3, 1, 3, 2]) == [1, 2, 3]",
            "assert unique_sorted([]) == []",
            "assert unique_sorted(['b', 'a', 'b']) == ['a', 'b']",
        ],
    ),
    (
        "`to_fahrenheit(celsius)` converts a temperature from degrees Celsius to degrees Fahrenheit.",
        "def to_fahrenheit(celsius):\n    return celsius * 9 / 5 + 32\n",
        [
            "assert to_fahrenheit(100) == 212",
            "assert to_fahrenheit(-40) == -40",
            "assert abs(to_fahrenheit(37) - 98.6) < 1e-9",
        ],
    ),
    (
        "`safe_divide(a, b)` returns a / b, or None when `b` is zero.",
        "def safe_divide(a, b):\n    return None if b == 0 else a / b\n",
        [
            "assert safe_divide(7, 2) == 3.5",
            "assert safe_divide(1, 0) is None",
            "assert safe_divide(0, 5) == 0",
        ],
    ),
    (
        "`acronym(phrase)` returns the upper-cased first letters of the space-separated words of `phrase`.",
        "def acronym(phrase):\n    return ''.join(w[0].upper() for w in phrase.split())\n",
        [
            "assert acronym('portable network graphics') == 'PNG'",
            "assert acronym('') == ''",
            "assert acronym('as soon as possible') == 'ASAP'",
        ],
    ),
    (
        "`group_by_length(words)` returns a dict mapping each word length to the list of words of that length, in "
        "their original order.",
        "def group_by_length(words):\n    out = {}\n    for w in words:\n        out.setdefault(len(w), []).append(w)\n"
        "    return out\n",
        [
            "assert group_by_length(['hi', 'sun', 'ox', 'car']) == {2: ['hi', 'ox'], 3: ['sun', 'car']}",
            "assert group_by_length([]) == {}",
            "assert group_by_length(['a']) == {1: ['a']}",
        ],
    ),
    (
        "`has_duplicates(items)` tells whether any value occurs more than once in `items`.",
        "def has_duplicates(items):\n    return len(set(items)) != len(items)\n",
        [
            "assert has_duplicates([1, 2, 1])",
            "assert not has_duplicates([])",
            "assert not has_duplicates(['a', 'b'])",
        ],
    ),
    (
        "`triangle_kind(a, b, c)` returns 'invalid' if the side lengths cannot form a triangle, else 'equilateral', "
        "'isosceles' or 'scalene'.",
        "def triangle_kind(a, b, c):\n    x, y, z = sorted((a, b, c))\n    if x <= 0 or x + y <= z:\n        return 'invalid'\n"
        "    if x == z:\n        return 'equilateral'\n    if x == y or y == z:\n        return 'isosceles'\n    return 'scalene'\n",
        [
            "assert triangle_kind(3, 4, 5) == 'scalene'",
            "assert triangle_kind(2, 2, 2) == 'equilateral'",
            "assert triangle_kind(1, 2, 3) == 'invalid'",
            "assert triangle_kind(5, 5, 8) == 'isosceles'",
        ],
    ),
    (
        "`count_digits(n)` returns how many decimal digits the integer `n` has (0 has one; ignore a minus sign).",
        "def count_digits(n):\n    return len(str(abs(n)))\n",
        ["assert count_digits(12345) == 5", "assert count_digits(0) == 1", "assert count_digits(-70) == 2"],
    ),
    (
        "`min_max(nums)` returns a tuple (smallest, largest) of a non-empty list of numbers.",
        "def min_max(nums):\n    return (min(nums), max(nums))\n",
        [
            "assert min_max([3, -2, 9]) == (-2, 9)",
            "assert min_max([4]) == (4, 4)",
            "assert min_max([1.5, 1.25]) == (1.25, 1.5)",
        ],
    ),
    (
        "`pair_up(keys, values)` returns a dict mapping each key to the value at the same position (extra items of "
        "the longer list are ignored).",
        "def pair_up(keys, values):\n    return dict(zip(keys, values))\n",
        [
            "assert pair_up(['a', 'b'], [1, 2]) == {'a': 1, 'b': 2}",
            "assert pair_up(['x'], [1, 2]) == {'x': 1}",
            "assert pair_up([], []) == {}",
        ],
    ),
    (
        "`balanced(s)` tells whether the brackets (), [] and {} in `s` are balanced and properly nested (other "
        "characters are ignored).",
        "def balanced(s):\n    pairs = {')': '(', ']': '[', '}': '{'}\n    stack = []\n    for c in s:\n        if c in '([{':\n"
        "            stack.append(c)\n        elif c in pairs:\n            if not stack or stack.pop() != pairs[c]:\n"
        "                return False\n    return not stack\n",
        [
            "assert balanced('f(a[1]) {x}')",
            "assert not balanced('(]')",
            "assert not balanced('((')",
            "assert balanced('')",
        ],
    ),
    (
        "`dot(a, b)` returns the dot product of two equally long lists of numbers.",
        "def dot(a, b):\n    return sum(x * y for x, y in zip(a, b))\n",
        ["assert dot([1, 2, 3], [4, 5, 6]) == 32", "assert dot([], []) == 0", "assert dot([2], [-3]) == -6"],
    ),
]
