"""Take the README's screenshot of the playground (docs/playground.png): the demo pair served
in-process, one answer drawn in headless Chromium (Debian's chromium + chromium-driver).

    PYTHONPATH=. python scripts/playground_screenshot.py [--out docs/playground.png]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from api_server import LiveServer  # noqa: E402
from blockspec import demo  # noqa: E402
from blockspec.llm import LLM  # noqa: E402
from servers import wait_until  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/playground.png")
    parser.add_argument("--prompt", default="def merge_sorted(a, b):")
    parser.add_argument("--max-tokens", default="120")
    args = parser.parse_args()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1360,860",
                     "--force-device-scale-factor=1"):
        options.add_argument(argument)
    target, draft = demo.require_built()
    llm = LLM(str(target), draft=str(draft), device="cpu", show_progress=False)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        with LiveServer(llm, "demo") as server:
            driver.get(server.url + "/")
            status = lambda: driver.find_element("id", "server-status").get_attribute("data-status")  # noqa: E731
            assert wait_until(lambda: status() == "ok")
            driver.execute_script("const t = document.getElementById('temperature'); t.value = '0';"
                                  "t.dispatchEvent(new Event('input'));"
                                  "document.getElementById('max-tokens').value = arguments[0];", args.max_tokens)
            driver.find_element("id", "prompt").send_keys(args.prompt)
            driver.find_element("id", "send").click()
            done = lambda: driver.find_elements("css selector", ".message.assistant[data-state='done']")  # noqa: E731
            assert wait_until(done, timeout=120)
            assert wait_until(lambda: driver.find_element("id", "live-running").text == "0")
            driver.save_screenshot(args.out)
    finally:
        driver.quit()
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
