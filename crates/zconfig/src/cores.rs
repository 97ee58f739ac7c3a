//! Which CPU cores a worker runs on: DeepSpeed's `--bind_core_list` syntax
//! (`0,2-4,6`), a host's physical cores, and each local rank's share of
//! them (DeepSpeed's `--bind_cores_to_rank`). zrun checks the list and the
//! share of a host it launches on before launch; each worker takes its
//! share where it runs, before any of its threads start.

use std::path::Path;

/// Parses `0,2-4,6` into `[0, 2, 3, 4, 6]`: numbers and inclusive ranges,
/// in ascending order, none overlapping (DeepSpeed's rules).
pub fn parse_core_list(text: &str) -> Result<Vec<usize>, String> {
    let mut cores: Vec<usize> = Vec::new();
    for part in text.split(',') {
        let number = |s: &str| {
            s.trim()
                .parse::<usize>()
                .map_err(|_| format!("`{part}` in `{text}`: not a core number or a range A-B"))
        };
        let (first, last) = match part.split_once('-') {
            Some((a, b)) => (number(a)?, number(b)?),
            None => {
                let n = number(part)?;
                (n, n)
            }
        };
        if first > last {
            return Err(format!(
                "`{part}` in `{text}`: a range must end at or after its start"
            ));
        }
        if cores.last().is_some_and(|&l| first <= l) {
            return Err(format!(
                "`{part}` in `{text}`: ranges go in ascending order without overlapping"
            ));
        }
        cores.extend(first..=last);
    }
    Ok(cores)
}

/// `[0, 1, 2, 5]` → `0-2,5`.
pub fn core_list_text(cores: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cores.len() {
        let mut j = i;
        while j + 1 < cores.len() && cores[j + 1] == cores[j] + 1 {
            j += 1;
        }
        parts.push(match j > i {
            true => format!("{}-{}", cores[i], cores[j]),
            false => cores[i].to_string(),
        });
        i = j + 1;
    }
    parts.join(",")
}

/// This host's physical cores: of the online logical CPUs, the first of
/// each core's hardware threads (DeepSpeed counts physical cores too: a
/// worker's threads on two hyperthreads of one core would share its units).
pub fn physical_cores() -> Result<Vec<usize>, String> {
    physical_cores_in(Path::new("/sys/devices/system/cpu"))
}

/// [`physical_cores`] from a sysfs CPU directory `root`; a CPU whose
/// siblings it cannot read counts as a core of its own.
pub fn physical_cores_in(root: &Path) -> Result<Vec<usize>, String> {
    let read = |p: &Path| std::fs::read_to_string(p).map(|s| s.trim().to_string());
    let online = read(&root.join("online"))
        .map_err(|e| format!("reading {}: {e}", root.join("online").display()))?;
    let online = parse_core_list(&online)?;
    let mut cores = Vec::new();
    for &cpu in &online {
        let siblings = root.join(format!("cpu{cpu}/topology/thread_siblings_list"));
        let first = read(&siblings)
            .ok()
            .and_then(|s| parse_core_list(&s).ok())
            .and_then(|s| s.into_iter().find(|c| online.contains(c)));
        if first.is_none_or(|f| f == cpu) {
            cores.push(cpu);
        }
    }
    Ok(cores)
}

/// Local rank `local_rank`'s share of `cores` among `local_workers`
/// workers: the same number each, in order, the rest unused (as DeepSpeed
/// shares them).
pub fn share(cores: &[usize], local_workers: usize, local_rank: usize) -> Result<&[usize], String> {
    let each = cores.len() / local_workers.max(1);
    if each == 0 {
        return Err(format!(
            "{} core(s) ({}) cannot be shared by {local_workers} workers: each needs one",
            cores.len(),
            core_list_text(cores)
        ));
    }
    Ok(&cores[each * local_rank..each * (local_rank + 1)])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse_as_deepspeed_reads_them_and_print_back() {
        assert_eq!(parse_core_list("0,2-4,6").unwrap(), [0, 2, 3, 4, 6]);
        assert_eq!(parse_core_list("7").unwrap(), [7]);
        assert_eq!(parse_core_list("3-3").unwrap(), [3]);
        for (bad, says) in [
            ("", "not a core number"),
            ("0-", "not a core number"),
            ("a", "not a core number"),
            ("4-2", "must end at or after its start"),
            ("0-3,2", "ascending order"),
            ("5,1", "ascending order"),
        ] {
            let e = parse_core_list(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        for text in ["0-2,5", "1", "0,2,4", "8-11,16-19"] {
            assert_eq!(core_list_text(&parse_core_list(text).unwrap()), text);
        }
    }

    /// Four logical CPUs on two cores (0 and 2 share one, 1 and 3 the
    /// other), and CPU 5 online without topology.
    #[test]
    fn physical_cores_are_the_first_thread_of_each_core() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("online"), "0-3,5\n").unwrap();
        for (cpu, siblings) in [(0, "0,2"), (1, "1,3"), (2, "0,2"), (3, "1,3")] {
            let t = d.path().join(format!("cpu{cpu}/topology"));
            std::fs::create_dir_all(&t).unwrap();
            std::fs::write(t.join("thread_siblings_list"), format!("{siblings}\n")).unwrap();
        }
        assert_eq!(physical_cores_in(d.path()).unwrap(), [0, 1, 5]);
        assert!(physical_cores_in(&d.path().join("none")).is_err());
    }

    #[test]
    fn each_local_rank_gets_an_equal_share_in_order() {
        let cores = parse_core_list("0-6").unwrap();
        assert_eq!(share(&cores, 3, 0).unwrap(), [0, 1]);
        assert_eq!(share(&cores, 3, 2).unwrap(), [4, 5]);
        assert_eq!(share(&cores, 1, 0).unwrap(), cores.as_slice());
        let e = share(&cores[..1], 2, 1).unwrap_err();
        assert!(
            e.contains("1 core(s) (0) cannot be shared by 2 workers"),
            "{e}"
        );
    }
}
