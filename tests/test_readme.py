"""The README's Learning path prints what it shows (issues 31, 37): every command of the course, typed as printed
in a fresh directory holding the project's files and data/shakespeare_char (and data/shakespeare) prepared offline
as the quickstart says, prints the lines of the "You should see" block below it. Times (ms, tok/s, s, %) vary from
machine to machine and are masked, as is what the README writes as "..."; losses, byte counts and every other
figure match to the printed digit, except where a format's rounding moves the curve between CPUs (TOLERANCE)."""
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from harness import ROOT, file_flags, free_port, launch_env, two_at_a_time

TIMED = re.compile(r"\d+(?:\.\d+)?(?:e[+-]?\d+)?\s*(?:ms|tok/s|s|%|x)(?=\W|$)")


NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[+-]?\d+)?")

# Lessons whose printed figures may move between CPUs, by how much (relative), and why. fp8.py: one e4m3 rounding
# that lands the other way (a different fp32 sum order in another CPU's GEMM kernel) moves that element by one e4m3
# step, 2^-3 relative; the curve carries a few such flips a step: measured 1.3e-5 relative on the loss at step 19
# between two CPUs (issue 37), so 1e-4 is shown as 4 decimals of a loss near 3 moving by at most 3 units.
TOLERANCE = {"fp8.py": 1e-4}


def normalize(line):
    """Times masked, runs of spaces collapsed: what must match to the digit is everything else."""
    return " ".join(TIMED.sub("#", line).split())


def same_line(shown, printed, tol):
    """printed matches shown: the same words, every figure equal (within tol relative, where tol > 0)."""
    if not tol:
        return printed == shown
    if NUMBER.sub("#", printed) != NUMBER.sub("#", shown):
        return False
    pairs = zip(NUMBER.findall(shown), NUMBER.findall(printed))
    return all(abs(float(a) - float(b)) <= tol * abs(float(a)) + 1e-12 for a, b in pairs)


def course():
    """[(section title, [command lines], [expected lines])] of README.md's '## Learning path'."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    start = text.index("## Learning path")
    end = text.find("\n## ", start + 1)
    path = text[start: end if end > 0 else len(text)]
    lessons = []
    for section in re.split(r"\n### ", path)[1:]:
        title = section.splitlines()[0]
        blocks = re.findall(r"```(\w*)\n(.*?)```", section, re.S)
        shown = re.search(r"You should see.*?:\n```\w*\n(.*?)```", section, re.S)
        commands = [ln.strip() for lang, body in blocks if lang == "bash" for ln in body.splitlines()
                    if ln.strip() and not ln.strip().startswith("#")]
        if commands:
            lessons.append((title, commands, shown.group(1).splitlines() if shown else []))
    return lessons


LESSONS = course()


def try_commands():
    """[(section title, command)] of every `python ...` / `torchrun ...` in a lesson's "Try:" paragraph."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    found = []
    for section in re.split(r"\n### ", text[text.index("## Learning path"):])[1:]:
        for paragraph in re.findall(r"Try:(.*?)(?:\n\n|\n###|$)", section, re.S):
            for command in re.findall(r"`((?:python|torchrun) [^`]*)`", paragraph):
                found.append((section.splitlines()[0], " ".join(command.split())))
    return found


def test_every_try_line_runs_as_typed():
    """A "Try:" command typed as printed: each flag exists in its file, and it writes to its own --out (the
    lesson's directory holds the lesson's run: the same --out would be refused)."""
    tries = try_commands()
    assert len(tries) >= 9, tries
    outs = [c.split("--out")[1].split()[0] for _, cs, _ in LESSONS for c in cs if "--out" in c]
    for title, command in tries:
        argv = command.split()
        name = next(a for a in argv if a.endswith(".py"))
        flags = {a.split("=")[0] for a in argv if a.startswith("--") and argv.index(a) > argv.index(name)}
        assert flags <= file_flags(name) | {"--help"}, f"README lesson {title!r}: `{command}`: " \
            f"{sorted(flags - file_flags(name))} not flags of {name}"
        assert "--out" in flags or argv[argv.index(name) + 1:argv.index(name) + 2] in (["sample"], ["demo"]), \
            f"README lesson {title!r}: `{command}` names no --out"
        if "--out" in flags:
            out = argv[argv.index("--out") + 1]
            assert out not in outs, f"README lesson {title!r}: `{command}` writes to {out}, which another " \
                                    "command of the course writes"
            outs.append(out)


def test_every_lesson_has_a_command_and_what_it_prints():
    assert len(LESSONS) >= 9, [t for t, _, _ in LESSONS]
    for title, commands, shown in LESSONS:
        assert shown, f"README lesson {title!r}: no 'You should see' block"
        assert all(c.split()[0] in ("python", "torchrun") for c in commands), (title, commands)


@pytest.fixture(scope="module")
def fresh_clone(tmp_path_factory, shakespeare, shakespeare_char):
    """The project's files in a new directory, the data prepared offline (as the quickstart's lines)."""
    d = tmp_path_factory.mktemp("clone")
    for name in os.listdir(ROOT):
        if name.endswith(".py") or name in ("requirements.txt",):
            shutil.copy(os.path.join(ROOT, name), d / name)
    shutil.copytree(shakespeare, d / "data" / "shakespeare")
    shutil.copytree(shakespeare_char, d / "data" / "shakespeare_char")
    return d


def run(command, cwd):
    argv = command.split()
    if argv[0] == "torchrun":  # the same launcher, on a port no other test holds
        argv = [sys.executable, "-m", "torch.distributed.run", f"--master_port={free_port()}", *argv[1:]]
    elif argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    env = {k: v for k, v in launch_env().items() if k != "PYTHONPATH"}  # the clone's own gpt2.py
    t0 = time.time()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    return proc, time.time() - t0


def run_lesson(commands, cwd):
    """A lesson's commands one after another (checkpoint.py resumes what its first command saved)."""
    done = []
    for command in commands:
        proc, seconds = run(command, cwd)
        done.append((command, proc, seconds))
    return done


@pytest.fixture(scope="module")
def lesson_runs(request, fresh_clone):
    """Every selected lesson, two at a time (on 2 cores one lesson's start-up overlaps the other's steps): the
    tests below wait for their own."""
    yield from two_at_a_time(request, "test_lesson_prints_what_the_readme_shows", "lesson",
                             lambda i: run_lesson(LESSONS[i][1], fresh_clone))


@pytest.mark.parametrize("lesson", range(len(LESSONS)), ids=[t.split(":")[0] for t, _, _ in LESSONS])
def test_lesson_prints_what_the_readme_shows(lesson, lesson_runs):
    title, commands, shown = LESSONS[lesson]
    out = ""
    for command, proc, seconds in lesson_runs[lesson].result():
        print(f"{command}: {seconds:.1f} s (beside another lesson)")
        dies = "--fail-at" in command  # the lesson's simulated crash: a rank exits abruptly, torchrun ends the job
        assert (proc.returncode != 0) == dies, f"README lesson {title!r}: `{command}` exited {proc.returncode}\n" \
                                               f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        out += proc.stdout + proc.stderr
    printed = {normalize(ln) for ln in out.splitlines()}
    tol = next((t for name, t in TOLERANCE.items() if name in title), 0)
    for line in shown:
        if line.strip() and not line.strip().startswith("..."):
            # "..." in a shown line stands for a figure that varies from run to run (a measured fraction, RSS)
            pattern = re.compile(".*".join(re.escape(part) for part in normalize(line).split("...")))
            assert any(pattern.fullmatch(p) or same_line(normalize(line), p, tol) for p in printed), \
                f"README lesson {title!r} shows a line the command does not print:\n  shown:   {line}\n" \
                f"  printed: {next((p for p in out.splitlines() if p.split('|')[0] == line.split('|')[0]), '(none)')}"
